"""Episode journals on disk under hostile prompt ids and damaged lines: every group's folder is named by a hash
of its id (no id names `.`, `..`, a long name or another group's folder), the id itself is kept inside, and a
line whose fields do not add up is taken for a torn one."""

from __future__ import annotations

import json

from areal_hpc.control import fsio
from areal_hpc.gen.journal import Entry, Journals, read_entries, request_key

HOSTILE_IDS = [".", "..", "../epoch1", "a/b", "x" * 300, "-rf *", "q1\u0301"]


def entry(n: int = 3) -> Entry:
    return Entry(request_key([1, 2, n], {}), list(range(n)), [-0.5] * n, [0] * n, "stop")


def test_no_prompt_id_can_name_or_remove_another_group_s_folder(tmp_path):
    journals = Journals(tmp_path)
    for epoch, query_id in [(0, "q1"), (1, "q1"), *((0, q) for q in HOSTILE_IDS)]:
        journals.episode(epoch, query_id, 0).append(entry())
    folders = sorted(p for p in tmp_path.glob("epoch*/*") if p.is_dir())
    assert len(folders) == 2 + len(HOSTILE_IDS)  # each id a folder of its own, inside its epoch
    assert all(len(p.name) <= 65 and p.parent.parent == tmp_path for p in folders)
    for (
        query_id
    ) in HOSTILE_IDS:  # ending the group of '.' used to remove all of epoch 0, of '..' every epoch's
        assert fsio.read_json(journals.group(0, query_id) / "id.json") == {"query_id": query_id, "epoch": 0}
        journals.remove_group(0, query_id)
    assert len(read_entries(journals.group(0, "q1") / "0.jsonl")[0]) == 1
    assert len(read_entries(journals.group(1, "q1") / "0.jsonl")[0]) == 1


def test_used_groups_journals_are_pruned_by_their_ids(tmp_path):
    journals = Journals(tmp_path)
    for query_id in ("q1", "q2", ".."):
        journals.episode(0, query_id, 0).append(entry())
    assert journals.prune({0: {"q1", "..", "never-started"}, 3: {"q9"}}) == 2
    assert [p.name for p in tmp_path.glob("epoch0/*")] == [journals.group(0, "q2").name]


def test_a_line_whose_fields_disagree_is_taken_for_a_torn_one(tmp_path):
    path = tmp_path / "0.jsonl"
    good = entry().line()
    uneven = json.loads(entry().line())
    uneven["logprobs"] = json.loads(Entry("0" * 64, [0, 1], [0.0, 0.0], [0, 0], "stop").line())["logprobs"]
    bad_lines = [
        json.dumps(uneven).encode() + b"\n",  # 3 ids, 2 logprobs: it used to stop the role
        good.replace(b'"stop"', b'"maybe"'),
        good.replace(request_key([1, 2, 3], {}).encode(), b"../../x"),
        b"[" * 5000 + b"\n",
    ]
    for bad in bad_lines:
        path.write_bytes(good + bad + good)
        entries, size = read_entries(path)
        assert entries == [entry()] and size == len(good), bad[:40]
    # Opened again, the journal keeps its good lines and appends after them.
    journal = Journals(tmp_path).episode(0, "q1", 0)
    journal.path.parent.mkdir(parents=True)
    journal.path.write_bytes(good + bad_lines[0])
    journal = Journals(tmp_path).episode(0, "q1", 0)
    assert journal.replay(entry().key) == entry()
    journal.append(entry(4))
    assert read_entries(journal.path)[0] == [entry(), entry(4)]
