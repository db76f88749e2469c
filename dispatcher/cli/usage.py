"""What `--help` says about each command: a one-line summary, its exit codes and an example."""

from __future__ import annotations

MAIN = """\
The config is the first of --config FILE, $DISPATCHER_CONFIG, ./config/dispatcher.yaml
and /etc/dispatcher/dispatcher.yaml; relative paths in it resolve against its folder.

exit codes:
  0  success
  1  the operation failed (a job not found, a job in the wrong state, a job or
     refused file under run --once)
  2  bad usage or invalid input (a bad order or config, no config found), with a
     one-line error on stderr

example:
  dispatcher init ./dispatch && dispatcher run
  dispatcher COMMAND --help     # what a command does, its exit codes and an example"""

BAD = "bad usage, a bad config or none found"
#: the states `list --state` takes (contract 7): `failed` is failed jobs, `refused` refused files
_IDS = "each ID on its own; - reads ids from stdin, one a line"

# command -> (summary, exit codes, examples)
COMMANDS: dict[str, tuple[str, str, str]] = {
    "init": (
        "make the dispatch root and a starter config (never overwrites)",
        f"0 the root and the config are there (made now or before)\n1 a folder or the config cannot be written\n"
        f"2 {BAD.replace(' or none found', '')}",
        "dispatcher init ./dispatch        # writes ./config/dispatcher.yaml when there is none\n"
        "dispatcher --config /etc/dispatcher/dispatcher.yaml init /var/lib/dispatcher/dispatch",
    ),
    "run": (
        "run the daemon (exit 0 after a graceful stop)",
        "0 a graceful stop; under --once: every job it finished is done and no file was refused\n"
        "1 under --once: a job failed or a file was refused\n"
        f"2 {BAD}, a root that does not exist, a log_file that cannot be opened",
        "dispatcher run\ndispatcher run --once && echo 'every job is done'",
    ),
    "submit": (
        "validate orders and drop them into inbox/ atomically; print each job id",
        f"0 every order was dropped\n2 an invalid order, a job id already known, {BAD}",
        "dispatcher submit orders/JOB-001.yaml\ndispatcher submit --in 2h orders/JOB-002.yaml",
    ),
    "validate": (
        "check orders (or, with no FILE, the config and its agents' programs) without submitting",
        "0 every order (or the config) is valid; warnings, if any, are on stderr\n"
        f"2 an invalid order or config, an agent program missing or not executable, {BAD}",
        "dispatcher validate orders/*.yaml\ndispatcher validate --config /etc/dispatcher/dispatcher.yaml",
    ),
    "status": (
        "counts per state, the daemons on this root, the active jobs and the spend of the last 24 h",
        f"0 printed\n2 {BAD}, a root that does not exist",
        "dispatcher status\ndispatcher status --json | jq .counts",
    ),
    "list": (
        "one line per job or refused file, newest first: id, state, agent, age, cost, reason",
        f"0 printed (also when nothing matched)\n2 {BAD}, a root that does not exist, an unknown --state",
        "dispatcher list --state failed\ndispatcher list --agent assigner --json | jq -r .job_id",
    ),
    "show": (
        "one job: state, checks, attempts (argv, host, cost, stderr of a failure), its chain",
        f"0 printed (a refused file too)\n1 no such job or refused file\n2 {BAD}, a root that does not exist",
        "dispatcher show JOB-001\ndispatcher show --tree JOB-001",
    ),
    "retry": (
        f"run failed jobs again, with max_attempts more attempts ({_IDS})",
        f"0 every retry is recorded\n1 an id is unknown or not failed (one line each on stderr)\n"
        f"2 {BAD}, a root that does not exist",
        "dispatcher retry JOB-001 JOB-002\ndispatcher list --state failed --json | jq -r .job_id | dispatcher retry -",
    ),
    "cancel": (
        f"stop queued or running jobs; they fail with reason cancelled ({_IDS})",
        f"0 every cancel is recorded\n1 an id is unknown or finished (one line each on stderr)\n"
        f"2 {BAD}, a root that does not exist",
        "dispatcher cancel JOB-001\ndispatcher cancel --tree PLAN-001   # the job and every descendant",
    ),
    "hold": (
        f"move queued orders from inbox/ into held/, where no daemon claims them ({_IDS})",
        f"0 every order is held\n1 an id is not queued in inbox/ (one line each on stderr)\n"
        f"2 {BAD}, a root that does not exist",
        "dispatcher hold JOB-001 JOB-002\ndispatcher list --state inbox --json | jq -r .job_id | dispatcher hold -",
    ),
    "release": (
        f"move held orders back into inbox/, follow-ups held by budget included ({_IDS})",
        f"0 every order is back in inbox/\n1 an id is not held (one line each on stderr)\n"
        f"2 {BAD}, a root that does not exist",
        "dispatcher release JOB-001",
    ),
    "approve": (
        f"move jobs waiting in review/ to done/ and release their follow-ups ({_IDS})",
        f"0 every job is approved\n1 an id is unknown or not waiting for review (one line each on stderr)\n"
        f"2 {BAD}, a root that does not exist",
        "dispatcher approve JOB-001.assign\n"
        "dispatcher list --state review --json | jq -r .job_id | dispatcher approve -",
    ),
    "land": (
        f"run the land hook of done jobs again, after it failed ({_IDS})",
        f"0 every job landed\n1 an id is unknown, not done, has no land hook, or its hook failed (one line each)\n"
        f"2 {BAD}, a root that does not exist",
        "dispatcher land JOB-001",
    ),
    "reject": (
        f"move jobs waiting in review/ to failed/ with reason `rejected: TEXT` ({_IDS})",
        f"0 every job is rejected\n1 an id is unknown or not waiting for review (one line each on stderr)\n"
        f"2 {BAD}, a root that does not exist",
        'dispatcher reject JOB-001.assign --reason "wrong team for R2"',
    ),
    "revise": (
        f"send jobs in review/ or failed/ back for one more attempt with a note in work/feedback.json ({_IDS})",
        f"0 every revision is recorded\n1 an id is unknown, not in review or failed, or out of max_revisions"
        f" (one line each on stderr)\n2 {BAD}, no --note, a root that does not exist",
        'dispatcher revise JOB-001 --note "use the team list of 2026"',
    ),
    "pause": (
        "gate agents by hand: no new attempt of them starts on any host (running ones go on)",
        f"0 every agent is paused\n1 an agent is not in the config (one line each on stderr)\n2 {BAD}",
        "dispatcher pause coder",
    ),
    "resume": (
        "lift the gates of agents: a pause, a usage limit or a daily cap",
        f"0 every gate is lifted\n1 an agent is unknown or not gated (one line each on stderr)\n2 {BAD}",
        "dispatcher resume coder\ndispatcher resume '*'   # the root's daily cap, which holds every agent",
    ),
    "logs": (
        "read JSON log lines (log_file, FILE, or - for stdin) as lines a person reads",
        f"0 printed (with -f: until you stop it)\n2 no such FILE, log_file not set, {BAD}\n130 stopped with Ctrl-C",
        "dispatcher logs -f --job JOB-001\njournalctl -o cat -u dispatcher | dispatcher logs -",
    ),
    "ledger": (
        "rebuild a lost SQLite ledger from the job folders, or migrate it to PostgreSQL",
        f"0 done\n1 the target is not empty, or it cannot be reached\n2 a daemon is running, {BAD}",
        "dispatcher ledger rebuild        # with every daemon stopped\n"
        "dispatcher ledger migrate postgresql://dispatcher@db/dispatcher",
    ),
    "reload": (
        "ask this root's live daemons on this host to reload their config (SIGHUP), after checking it",
        "0 every live daemon was asked\n1 no daemon of this root runs on this host, or one could not be asked "
        f"(under systemd: use systemctl reload)\n2 the config is invalid, {BAD}",
        "dispatcher reload\nsystemctl reload dispatcher      # for a daemon that systemd runs",
    ),
    "unit": (
        "print the systemd unit for the installed command (or the template, logrotate file, notify examples)",
        "0 printed\n2 bad usage",
        "dispatcher unit > /etc/systemd/system/dispatcher.service\n"
        "dispatcher unit --template > /etc/systemd/system/dispatcher@.service\n"
        "dispatcher unit --logrotate > /etc/logrotate.d/dispatcher",
    ),
    "completion": (
        "print the shell completion script for bash, zsh or fish",
        "0 printed\n2 bad usage (a shell other than bash, zsh or fish)",
        'eval "$(dispatcher completion bash)"     # in ~/.bashrc\n'
        'eval "$(dispatcher completion zsh)"      # in ~/.zshrc, after compinit\n'
        "dispatcher completion fish | source      # in ~/.config/fish/config.fish",
    ),
    "web": (
        "serve the web view (overview, jobs, chains, review queue, JSON API) until SIGTERM or SIGINT",
        "0 stopped by SIGTERM or SIGINT\n"
        f"2 {BAD}, a root that does not exist, a non-loopback --listen without web_token_file,"
        " an unreadable token file, an address that cannot be bound, the [web] extra missing",
        "dispatcher web                          # http://127.0.0.1:8700/, prints a token once\n"
        "dispatcher web --listen 0.0.0.0:8700    # needs web_token_file in the config",
    ),
}


def epilog(command: str | None) -> str:
    """Return the text after a command's (or, for None, the program's) options in `--help`."""
    if command is None:
        return MAIN
    _, codes, example = COMMANDS[command]
    code_lines = "\n".join(
        f"  {code:<3} {text}" for code, _, text in (line.partition(" ") for line in codes.splitlines())
    )
    examples = "\n".join("  " + line for line in example.splitlines())
    return f"exit codes:\n{code_lines}\n\nexample:\n{examples}"


def summary(command: str) -> str:
    """Return a command's one-line summary."""
    return COMMANDS[command][0]
