#!/bin/bash
# One device-tool call of tools/gpu_issue46.sh: SECONDS PART...  (SECONDS under the session's device time left).
# The parts write to /tmp/out; the tool's $OUT gets all of it packed (r.tgz) after each part, and the whole log,
# so what finished comes back from a call that is killed. The tool returns at most 8 files: hence the tarball.
limit=$1; shift
export BACK=$OUT OUT=/tmp/out
mkdir -p $OUT
timeout $limit bash tools/gpu_issue46.sh "$@" > $OUT/all.log 2>&1
echo "exit code $?" >> $OUT/all.log
cp $OUT/all.log $BACK/
tail -c 9000 $OUT/all.log
