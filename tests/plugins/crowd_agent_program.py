"""An agent program that counts the programs running beside it (tests/test_agent_programs.py): it leaves a mark
in $CROWD_DIR/running while it runs, counts the marks there before it removes its own, and writes the count to
$CROWD_DIR/seen. Standard library only; its reward is 1.

    python crowd_agent_program.py
"""

import os
import time
import uuid

folder = os.environ["CROWD_DIR"]
name = uuid.uuid4().hex
mark = os.path.join(folder, "running", name)
open(mark, "w").close()
time.sleep(0.4)
count = len(os.listdir(os.path.join(folder, "running")))
os.remove(mark)
with open(os.path.join(folder, "seen", name), "w") as f:
    f.write(str(count))
print(1.0)
