"""Images: uint8 off the workers, normalised on the device; JPEG draft decoding; the decode-once image cache."""

import json
import os
import shutil

import numpy as np
import pytest
import torch
from PIL import Image
from test_data import make_cfg

from shardtrain.cli import main as cli_main
from shardtrain.config.settings import ConfigError, replace_fields
from shardtrain.data import batch_to_device, build_datasets, build_tokenizer, make_data
from shardtrain.data.image_cache import build_image_cache
from shardtrain.data.images import decode_image, load_image, normalize_pixels
from shardtrain.data.precheck import check_splits


def host_normalized(path, size):
    """What the loader workers computed before images were normalised on the device."""
    with Image.open(path) as img:
        arr = np.asarray(img.convert("RGB").resize((size, size), Image.BILINEAR), dtype=np.float32) / 255.0
    x = torch.from_numpy(arr).permute(2, 0, 1)
    return (x - torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1)) / torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)


@pytest.fixture()
def data(tmp_path):
    return make_data("multimodal", tmp_path / "data", n_train=24, n_val=8, seed=3)


def test_device_normalisation_is_bit_identical_to_the_host_one(data):
    image = data / json.loads((data / "train.jsonl").read_text().splitlines()[0])["image"]
    pixels = load_image(image, 32)
    assert pixels.dtype == torch.uint8 and pixels.shape == (3, 32, 32)
    batch = batch_to_device({"pixel_values": torch.stack([pixels]), "labels": torch.tensor([1])}, torch.device("cpu"))
    assert batch["pixel_values"].dtype == torch.float32
    assert torch.equal(batch["pixel_values"][0], host_normalized(image, 32))
    floats = torch.randn(1, 3, 4, 4)  # already-normalised inputs (export users, the planner) pass through
    assert torch.equal(batch_to_device({"pixel_values": floats}, torch.device("cpu"))["pixel_values"], floats)
    assert normalize_pixels(torch.full((1, 3, 1, 1), 255, dtype=torch.uint8)).flatten().tolist() == pytest.approx(
        [(1 - 0.485) / 0.229, (1 - 0.456) / 0.224, (1 - 0.406) / 0.225]
    )


def test_large_jpeg_decodes_reduced_and_close_to_a_full_decode(tmp_path):
    rng = np.random.default_rng(0)
    # A smooth photo-like image (noise would punish any downscaling method alike).
    yy, xx = np.mgrid[0:1200, 0:1600]
    arr = np.stack([(xx / 1600 * 255), (yy / 1200 * 255), ((xx + yy) % 256)], axis=-1).astype(np.uint8)
    arr = np.clip(arr.astype(int) + rng.integers(-3, 4, arr.shape), 0, 255).astype(np.uint8)
    path = tmp_path / "photo.jpg"
    Image.fromarray(arr).save(path, quality=92)
    with Image.open(path) as img:
        img.draft("RGB", (224, 224))
        assert img.size == (400, 300)  # libjpeg's 1/4 scale: the smallest that stays >= 224 on both sides
    fast = decode_image(path, 224).astype(int)
    with Image.open(path) as img:
        full = np.asarray(img.convert("RGB").resize((224, 224), Image.BILINEAR)).astype(int)
    assert fast.shape == (224, 224, 3)
    assert np.abs(fast - full).mean() < 2.0  # out of 255


def test_cached_items_equal_decoded_items(data, tmp_path):
    cfg = make_cfg(data)
    out = build_image_cache(data / "train.jsonl", "multimodal", 3, tmp_path / "cache", 32, workers=2)
    assert out["images"] == 24 and out["bad"] == 0 and out["bytes"] >= 24 * 32 * 32 * 3
    build_image_cache(data / "validation.jsonl", "multimodal", 3, tmp_path / "cache", 32, workers=1)
    plain, _ = build_datasets(cfg)
    cfg = replace_fields(cfg, image_cache=str(tmp_path / "cache"))
    cached, cached_eval = build_datasets(cfg)
    assert cached.cache is not None and cached_eval.cache is not None
    for i in range(len(plain)):
        a, b = plain[i], cached[i]
        assert a["text"] == b["text"] and a["label"] == b["label"] and torch.equal(a["image"], b["image"])
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [
        "train-32.json",
        "train-32.npy",
        "validation-32.json",
        "validation-32.npy",
    ]


def test_missing_or_stale_cache_is_one_line_naming_the_flag(data, tmp_path):
    cfg = make_cfg(data, image_cache=str(tmp_path / "cache"))
    with pytest.raises(ConfigError, match=r"--image-cache \(data.image_cache\): no complete cache .*cache-images"):
        check_splits(cfg)
    for split in ("train", "validation"):
        build_image_cache(data / f"{split}.jsonl", "multimodal", 3, tmp_path / "cache", 32, workers=1)
    check_splits(cfg)
    cfg = replace_fields(cfg, image_size=64)
    with pytest.raises(ConfigError, match=r"no complete cache .* at 64px .*\(it has 32px: --image-size differs\?\)"):
        check_splits(cfg)
    cfg = replace_fields(cfg, image_size=32)
    image = data / json.loads((data / "train.jsonl").read_text().splitlines()[5])["image"]
    st = image.stat()
    os.utime(image, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # an edited image
    with pytest.raises(ConfigError, match=f"{image.name} changed since"):
        check_splits(cfg)
    build_image_cache(data / "train.jsonl", "multimodal", 3, tmp_path / "cache", 32, workers=1)
    check_splits(cfg)
    with open(data / "train.jsonl", "a") as f:
        f.write((data / "train.jsonl").read_text().splitlines()[0] + "\n")
    with pytest.raises(ConfigError, match="train.jsonl changed since"):
        check_splits(cfg)


def test_cache_knows_bad_images_for_skip_bad_samples(data, tmp_path):
    lines = (data / "train.jsonl").read_text().splitlines()
    bad = data / json.loads(lines[2])["image"]
    bad.write_bytes(bad.read_bytes()[:40])  # header intact, pixel data truncated
    for split in ("train", "validation"):
        build_image_cache(data / f"{split}.jsonl", "multimodal", 3, tmp_path / "cache", 32, workers=1)
    cfg = make_cfg(data, image_cache=str(tmp_path / "cache"), skip_bad_samples=True)
    train_ds, _ = build_datasets(cfg)
    assert len(train_ds) == 23 and len(train_ds.skipped) == 1
    assert train_ds.skipped[0].startswith(f"{data / 'train.jsonl'}:3: cannot decode image")
    cfg = replace_fields(cfg, skip_bad_samples=False)
    train_ds, _ = build_datasets(cfg)
    with pytest.raises(
        ConfigError, match=r"train.jsonl:3: cannot decode image \S+: (OSError|SyntaxError|Unidentified)"
    ) as e:
        train_ds[2]
    assert "ValueError" not in str(e.value)  # PIL's reason as recorded, not wrapped in the cache's exception type
    cfg = replace_fields(cfg, image_size=64)
    with pytest.raises(ConfigError, match=r"cache-images <this run's --config and --data-dir flags> --image-size 64"):
        build_datasets(cfg)


def test_cache_images_command(data, tmp_path, capsys):
    config = tmp_path / "c.yaml"
    shutil.copy(os.path.join(os.path.dirname(__file__), "..", "..", "configs", "multimodal_tiny.yaml"), config)
    cache = tmp_path / "cache"
    args = ["cache-images", "--config", str(config), "--data-dir", str(data), "--output-dir", str(tmp_path / "o")]
    assert cli_main(args) == 2
    assert "--image-cache (data.image_cache) names the folder" in capsys.readouterr().err
    assert cli_main([*args, "--image-cache", str(cache), "--jobs", "1"]) == 0
    printed = capsys.readouterr().out
    assert "train.jsonl: 24 images" in printed and f"train with: --image-cache {cache}" in printed
    assert (cache / "train-32.json").is_file() and (cache / "validation-32.json").is_file()
    # Cheap to run before every job: an up-to-date cache is checked, not decoded again.
    assert cli_main([*args, "--image-cache", str(cache), "--jobs", "1"]) == 0
    assert "train.jsonl: up to date (24 images at 32px" in capsys.readouterr().out


def test_cache_images_says_first_that_the_model_reads_no_images(tmp_path, capsys):
    """Not first 'give --image-cache', and then, once given, that the model has no images to cache."""
    config = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "longformer_tiny.yaml")
    code = cli_main(["cache-images", "--config", config, "--output-dir", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert "cache-images: longformer reads no images: there is nothing to cache" in err


def test_bad_records_before_launch_are_counted_and_an_undecodable_image_says_the_way_on(data):
    """The pre-launch check stops at the first bad record; it says how many the split has and how to go on, so
    that a user does not fix one line per run. An image that only fails to decode is met by the run itself,
    whose line says the same."""
    lines = (data / "train.jsonl").read_text().splitlines()
    good = lines[:]
    lines[3] = json.dumps({k: v for k, v in json.loads(lines[3]).items() if k != "text"})
    lines[5] = json.dumps({**json.loads(lines[5]), "label": 9})
    (data / "train.jsonl").write_text("\n".join(lines) + "\n")
    counted = r"train\.jsonl:4: missing field 'text' \(2 bad records in train\.jsonl: shardtrain check-data .* lists"
    with pytest.raises(ConfigError, match=counted + r" them all, --skip-bad-samples .* leaves them out\)"):
        check_splits(make_cfg(data))
    lines[3] = good[3]
    (data / "train.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(ConfigError, match=r":6: label 9 .*\(the only bad record in train\.jsonl; --skip-bad-samples"):
        check_splits(make_cfg(data))

    (data / "train.jsonl").write_text("\n".join(good) + "\n")
    image = data / json.loads(good[0])["image"]
    image.write_bytes(b"\x89PNG\r\n\x1a\n" + b"\x00" * 40)
    check_splits(make_cfg(data))  # exists: decoding is the run's
    dataset = build_datasets(make_cfg(data), build_tokenizer(make_cfg(data), data / "run", True, lambda: None))[0]
    with pytest.raises(ConfigError, match=r"train\.jsonl:1: cannot decode image .*check-data lists every such image"):
        dataset[0]
