#!/bin/sh
# Installed with: dispatcher unit --notify append > /etc/dispatcher/notify-append.sh
# A notify command that appends one line per event to a file (the file named by $1).
#
#   notify: [sh, /etc/dispatcher/notify-append.sh, /var/log/dispatcher/events.txt, "{event}", "{job_id}", "{agent}", "{reason}"]
#
# Each line: time, event, job id, agent, reason, tab-separated.
set -eu
file=$1; shift
printf '%s\t%s\t%s\t%s\t%s\n' "$(date -u +%Y-%m-%dT%H:%M:%SZ)" "$1" "$2" "$3" "$4" >>"$file"
