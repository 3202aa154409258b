"""doc_to_visual for local datasets whose rows carry absolute media paths."""

from PIL import Image


def video(doc):
    return [doc["video_path"]]


def image(doc):
    return [Image.open(doc["image_path"]).convert("RGB")]
