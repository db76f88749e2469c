#!/bin/sh
# Installed with: dispatcher unit --notify webhook > /etc/dispatcher/notify-webhook.sh
# A notify command that posts the event as JSON to a webhook (Slack, a chat bot, a pager).
#
#   notify: [sh, /etc/dispatcher/notify-webhook.sh, "{event}", "{job_id}", "{agent}", "{reason}", "{result}"]
#   agents get no environment by default; the notify command gets PATH, HOME and LANG, so
#   give it the URL through its own file, or wrap it: the URL is read from $NOTIFY_WEBHOOK_URL
#   if set, else from the first line of ${NOTIFY_WEBHOOK_FILE:-/etc/dispatcher/webhook-url}.
#
# It exits non-zero when the post fails (the daemon logs notify.failed; the job is unchanged).
set -eu
url=${NOTIFY_WEBHOOK_URL:-$(head -n 1 "${NOTIFY_WEBHOOK_FILE:-/etc/dispatcher/webhook-url}")}
json_escape() { printf '%s' "$1" | sed 's/\\/\\\\/g; s/"/\\"/g'; }
body=$(printf '{"text": "dispatcher %s: %s (%s) %s", "result": "%s"}' \
    "$(json_escape "$1")" "$(json_escape "$2")" "$(json_escape "$3")" "$(json_escape "$4")" "$(json_escape "$5")")
exec curl --silent --show-error --fail --max-time 20 -H 'Content-Type: application/json' -d "$body" "$url"
