"""`coco` source: a COCO captions json (`captions_val2014.json`, ...) and its image folder.

One row per image by default: `caption` holds the first caption (lowest annotation id) and `captions`
all of them as a JSON list of strings, so the training dataset (which reads `caption`) works as is and
an evaluation can use every reference caption. `per_caption=True` writes one row per (image, caption)
instead, keyed `{image_id}_{annotation_id}`. Both add the integer `image_id`.
"""

import json
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

from convert.common import BASE_COLUMNS, ConvertError, Part, Skipped, chunk_name, readable_folder, unsafe_path
from convert.folder import read_file

COLUMNS_EXTRA = {"captions": "str", "image_id": "int64"}
PART_SIZE = 5_000


def load_annotations(src: str | Path) -> dict:
    path = Path(src).expanduser()
    try:
        data = json.loads(path.read_bytes())
    except OSError as err:
        raise ConvertError(f"--src {path}: cannot read the captions json ({err.strerror or err})") from None
    except ValueError as err:
        raise ConvertError(f"--src {path}: not valid JSON ({err})") from None
    if not isinstance(data, dict) or not isinstance(data.get("images"), list):
        raise ConvertError(f"--src {path}: not a COCO captions json (no 'images' list)")
    if not isinstance(data.get("annotations"), list):
        raise ConvertError(f"--src {path}: not a COCO captions json (no 'annotations' list)")
    return data


def parts(
    src: str | Path, images: str | Path, per_caption: bool = False, part_size: int = PART_SIZE
) -> list[Part]:
    data = load_annotations(src)
    images = readable_folder(images)
    captions = defaultdict(list)
    for ann in data["annotations"]:
        if isinstance(ann, dict) and "image_id" in ann:
            captions[ann["image_id"]].append((_sort_id(ann.get("id")), ann.get("id"), ann.get("caption")))
    records = []
    for image in data["images"]:
        if isinstance(image, dict) and "id" in image:
            caps = [
                (ann_id, text)
                for _, ann_id, text in sorted(captions.get(image["id"], []), key=lambda c: c[0])
            ]
            records.append((image["id"], image.get("file_name"), caps))
    records.sort(key=lambda r: _sort_id(r[0]))
    if not records:
        raise ConvertError(f"--src {src}: the captions json lists no images")
    chunks = [records[i : i + part_size] for i in range(0, len(records), part_size)]
    return [
        Part(chunk_name(i), read_images, (str(images), chunk, per_caption), _count(chunk, per_caption))
        for i, chunk in enumerate(chunks)
    ]


def _sort_id(value) -> tuple:
    return (0, value, "") if isinstance(value, int) else (1, 0, str(value))


def _count(records: list, per_caption: bool) -> int:
    return sum(max(1, len(caps)) for _, _, caps in records) if per_caption else len(records)


def read_images(images: str, records: list, per_caption: bool) -> Iterator[dict | Skipped]:
    root = Path(images)
    for image_id, file_name, caps in records:
        key = str(image_id)
        if not isinstance(file_name, str) or not file_name or unsafe_path(file_name):
            yield Skipped(key, "unsafe_path")
            continue
        data = read_file(root / file_name)
        if isinstance(data, str):
            yield Skipped(key, "missing_image" if not (root / file_name).exists() else data)
            continue
        texts = [t.strip() for _, t in caps if isinstance(t, str) and t.strip()]
        row = {"image": data, "captions": json.dumps(texts, ensure_ascii=False), "image_id": image_id}
        if not per_caption or not caps:
            yield {**row, "key": key, "caption": texts[0] if texts else None}
            continue
        for ann_id, text in caps:
            yield {**row, "key": f"{image_id}_{ann_id}", "caption": text}


COLUMNS = {**BASE_COLUMNS, **COLUMNS_EXTRA}
