import json
import os

from eagle3_resources.journal import Journal, read_journal


def test_records_survive_and_torn_tail_is_skipped_then_truncated(tmp_path):
    path = tmp_path / "j.jsonl"
    with Journal(path) as j:
        for i in range(3):
            j.append({"type": "result", "prompt_id": f"p{i}"})
    with open(path, "ab") as f:  # what kill -9 in the middle of a write leaves
        f.write(b'{"type": "result", "prompt_id": "p3", "cont')
    contents = read_journal(path)
    assert [r["prompt_id"] for r in contents.records] == ["p0", "p1", "p2"] and contents.torn_tail
    with Journal(path) as j:
        assert j.recovered_torn_tail
        j.append({"type": "result", "prompt_id": "p4"})
    contents = read_journal(path)
    assert [r["prompt_id"] for r in contents.records] == ["p0", "p1", "p2", "p4"] and not contents.torn_tail


def test_each_append_is_one_whole_line_on_disk_immediately(tmp_path):
    path = tmp_path / "j.jsonl"
    j = Journal(path, sync_every_s=60)
    j.append({"prompt_id": "a", "text": "多语言 ✓\n"})
    # another reader (or a crash right now) already sees the whole record
    assert json.loads(path.read_text().splitlines()[0])["text"] == "多语言 ✓\n"
    j.close()
    assert os.path.getsize(path) == len(path.read_bytes())
