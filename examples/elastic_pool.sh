#!/bin/sh
# An elastic worker pool: workers of one consumer group join and leave while messages wait, and
# nothing is lost. No partitions to rebalance: a worker that leaves hands back what it held.
#
#     qmq up &                                  # in another terminal
#     sh examples/elastic_pool.sh               # [META_URL [MESSAGES]]; QMQ=path/to/qmq
#
# 1. MESSAGES jobs (default 1200) are sent to a subject of this run.
# 2. A shell loop starts workers (qmq consume --group pool) in rounds: in each round three join,
#    each takes a share of the jobs and leaves; one leaves early, after a few.
# 3. A last worker drains what is left, then every job id is looked for in what the workers
#    printed: each was handled (at least once), or the script fails naming how many are lost.
set -eu
META=${1:-http://127.0.0.1:8090}
MESSAGES=${2:-1200}
QMQ=${QMQ:-qmq}
SUBJECT="pool.jobs.$$"
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT

$QMQ send "$SUBJECT" job --count "$MESSAGES" --json --meta "$META" > "$OUT/sent"
echo "sent $(wc -l < "$OUT/sent") jobs to $SUBJECT"

SHARE=$((MESSAGES / 12))
for round in 1 2 3 4; do
    # Three workers join; each leaves after its share (the third after a few), handing back
    # whatever it had pulled and not handled.
    $QMQ consume "$SUBJECT" --group pool --start earliest --count "$SHARE" \
        --idle-timeout-s 5 --meta "$META" > "$OUT/worker-$round-a" 2>/dev/null &
    $QMQ consume "$SUBJECT" --group pool --start earliest --count "$SHARE" \
        --idle-timeout-s 5 --meta "$META" > "$OUT/worker-$round-b" 2>/dev/null &
    $QMQ consume "$SUBJECT" --group pool --start earliest --count 5 \
        --idle-timeout-s 5 --meta "$META" > "$OUT/worker-$round-c" 2>/dev/null &
    wait
    echo "round $round: $(cat "$OUT"/worker-$round-* | wc -l) jobs handled by 3 workers, who left"
done
$QMQ consume "$SUBJECT" --group pool --start earliest --idle-timeout-s 5 --meta "$META" \
    > "$OUT/worker-last" 2>/dev/null
echo "last worker: $(wc -l < "$OUT/worker-last") jobs"

ids() { sed -n 's/.*"id": "\([^"]*\)".*/\1/p' "$@" | sort -u; }
ids "$OUT/sent" > "$OUT/sent-ids"
ids "$OUT"/worker-* > "$OUT/handled-ids"
LOST=$(comm -23 "$OUT/sent-ids" "$OUT/handled-ids" | wc -l)
HANDLED=$(cat "$OUT"/worker-* | wc -l)
echo "jobs: $(wc -l < "$OUT/sent-ids") sent, $HANDLED handled ($(wc -l < "$OUT/handled-ids") distinct), $LOST lost"
[ "$LOST" -eq 0 ]
