"""An agent program written only against the `openai` SDK: the client takes OPENAI_BASE_URL and OPENAI_API_KEY
from the environment, the record comes on stdin, the reward goes out as the last line of stdout.

    python sdk_agent_program.py [ok | noisy | hang | fail]
"""

import json
import os
import sys
import time

import openai

mode = sys.argv[1] if len(sys.argv) > 1 else "ok"
record = json.load(sys.stdin)
if mode == "hang":
    print("started", flush=True)
    time.sleep(3600)
client = openai.OpenAI(max_retries=0)
messages = [{"role": "user", "content": record["prompt"]}]
for turn in range(2):
    response = client.chat.completions.create(
        model=os.environ["OPENAI_MODEL"], messages=messages, max_tokens=8
    )
    messages += [response.choices[0].message, {"role": "user", "content": "Again."}]
    print(f"turn {turn}: {response.choices[0].finish_reason}", file=sys.stderr)
if mode == "noisy":
    print("x" * 5000)
if mode == "fail":
    sys.exit(3)
print(record["query_id"])
print(1.0 if record["solutions"] else 0.0)
