"""Small copies of the research datasets' published layouts (no download is possible here), with the mess real
copies have: a text file that is not UTF-8, a post with a text and no image, disagreeing annotators, a tie.

What each reader must drop from these copies is spelled out beside them (DROPPED_*), for the tests to compare.
"""

from __future__ import annotations

from pathlib import Path

from PIL import Image

LABELS = ("negative", "neutral", "positive")


def jpeg(path: Path, shade: int) -> None:
    """A real (tiny) JPEG; the shade follows the label, so a model has something to learn from the image."""
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (12, 10), (shade, 255 - shade, (shade * 7) % 256)).save(path, "JPEG")


def _pairs(label: str, annotators: int) -> str:
    return "\t".join(f"{label},{label}" for _ in range(annotators))


def make_mvsa(root: Path, multiple: bool = False, n_posts: int = 40) -> Path:
    """MVSA_Single/ (or MVSA/ for MVSA-Multiple): labelResultAll.txt (CRLF, as released) and data/<ID>.txt|jpg.
    Posts 1..n_posts agree on a label cycling through LABELS, except the special posts below."""
    top = root / ("MVSA" if multiple else "MVSA_Single")
    data = top / "data"
    data.mkdir(parents=True)
    k = 3 if multiple else 1
    lines = ["ID\t" + "\t".join(["text,image"] * k)]
    for post in range(1, n_posts + 1):
        label = LABELS[post % 3]
        labels = _pairs(label, k)
        text = f"post {post} feels {label} today".encode()
        image = True
        if post == 2:  # text positive, image neutral: kept as positive
            labels = "\t".join(["positive,neutral"] * k)
        if post == 3:  # positive against negative: dropped (labels_disagree)
            labels = "positive,negative\tpositive,negative\tneutral,negative" if multiple else "positive,negative"
        if post == 4 and multiple:  # the three text labels all differ: dropped (no_majority)
            labels = "positive,positive\tneutral,positive\tnegative,positive"
        if post == 5:  # a text and no image: dropped (missing_image)
            image = False
        if post == 6:  # an image and no text: dropped (missing_text)
            text = None
        if post == 7:  # Windows-1252, not UTF-8: "café" plus one byte undefined even there (0x81)
            text = b"caf\xe9 \x81 post 7 " + label.encode()
        if post == 8:  # a label that is not one of the three: dropped (malformed_line)
            labels = "\t".join(["happy,neutral"] * k)
        if post == 9:  # whitespace only: dropped (empty_text)
            text = b"  \n"
        lines.append(f"{post}\t{labels}")
        if text is not None:
            (data / f"{post}.txt").write_bytes(text)
        if image:
            jpeg(data / f"{post}.jpg", LABELS.index(label) * 100)
    (top / "labelResultAll.txt").write_bytes(("\r\n".join(lines) + "\r\n").encode())
    return top


# What the readers drop from make_mvsa's copies, by reason.
DROPPED_MVSA_SINGLE = {
    "labels_disagree": 1,
    "missing_image": 1,
    "missing_text": 1,
    "malformed_line": 1,
    "empty_text": 1,
}
DROPPED_MVSA_MULTIPLE = {**DROPPED_MVSA_SINGLE, "no_majority": 1}


def make_twitter(root: Path, name: str = "twitter2015", n_train: int = 24, n_dev: int = 8, n_test: int = 6) -> Path:
    """IJCAI2019_data/ as unpacked: <name>/{train,dev,test}.tsv (TomBERT's header and columns) and
    <name>_images/. In train.tsv: row 2 names a missing image, row 3 has no $T$, row 4 has 4 fields; row 5's
    tweet holds a U+2028 line separator."""
    top = root / "IJCAI2019_data"
    tsvs, images = top / name, top / f"{name}_images"
    tsvs.mkdir(parents=True)
    index = 0
    for split, n in (("train", n_train), ("dev", n_dev), ("test", n_test)):
        lines = ["index\t#1 Label\t#2 ImageID\t#3 String\t#3 String"]
        for i in range(1, n + 1):
            index += 1
            label = index % 3
            image_id = f"{index}.jpg"
            tweet = f"RT @ fan{index} : $T$ was {LABELS[label]} at the game 🏀"
            target = f"Team {index}"
            if split == "train" and i == 2:
                image_id = "404.jpg"  # not in <name>_images: dropped (missing_image)
            if split == "train" and i == 3:
                tweet = "no target marker here"  # dropped (no_target_marker)
            if split == "train" and i == 5:
                tweet += "\u2028second line"  # a line separator inside a field, as real tweets have: one row
            if split == "train" and i == 4:
                lines.append(f"{index}\t{label}\t{image_id}\t{tweet}")  # dropped (malformed_line)
                continue
            if image_id != "404.jpg":
                jpeg(images / image_id, label * 100)
            lines.append(f"{index}\t{label}\t{image_id}\t{tweet}\t{target}")
        (tsvs / f"{split}.tsv").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return top


DROPPED_TWITTER = {"missing_image": 1, "no_target_marker": 1, "malformed_line": 1}
