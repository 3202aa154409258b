"""Smoke task helpers: the JSONL stores each video's absolute path (written by the fixtures command)."""


def smoke_doc_to_visual(doc):
    return [doc["video_path"]]
