"""What the image section's ``draft`` buys on phone-sized photos: decoding and transforming one JPEG through
TorchServe's ``image_classifier`` transforms (RGB, Resize(256), CenterCrop(224), ToTensor, Normalize), every pixel
decoded against decoded reduced by libjpeg (Pillow's ``draft``, to no less than twice the resized size).

For each size it makes a photo-like JPEG (gradients, hard-edged discs, sensor-like noise; quality 90; seeded) and
reports, on one core (as a decoding thread runs):

* milliseconds per image, exact and drafted (the minimum of ``--repeats`` runs, each timed alone), and their ratio;
* how far the drafted pixels are from the exact ones, in levels of 0..255 (the transform's scale 1, no normalising):
  mean, 99th percentile and max of the absolute difference.

    python benchmarks/jpeg_draft.py --out benchmarks/results/jpeg-draft-cpu/draft
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import common
import numpy as np
import torch
from photos import jpeg, photo

from halfserve import hostinfo, images
from halfserve.imageinput import ImageInput, ImagePreset
from halfserve.settings import MAX_IMAGE_PIXELS

SIZES = [(1280, 960), (2048, 1536), (4032, 3024), (4000, 3000)]
"""About 1.2, 3.1, 12.2 and 12 megapixels: a phone's reduced, default and full-resolution photos."""


def section(draft: bool, normalised: bool) -> ImageInput:
    fields: dict[str, object] = {**ImagePreset.TORCHSERVE.transforms, "draft": draft}
    if not normalised:
        fields |= {"scale": 1.0, "mean": None, "std": None}
    return ImageInput.model_validate({"input": "photo", "feeds": "image", **fields})


def best_ms(data: bytes, spec: ImageInput, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        images.decode(data, spec, MAX_IMAGE_PIXELS, "photo")
        times.append(time.perf_counter() - started)
    return 1000 * min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=Path, help="write <out>.json and <out>.md")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    for width, height in SIZES:
        data = jpeg(photo(width, height))
        exact_ms = best_ms(data, section(False, True), args.repeats)
        draft_ms = best_ms(data, section(True, True), args.repeats)
        exact = images.decode(data, section(False, False), MAX_IMAGE_PIXELS, "photo")
        drafted = images.decode(data, section(True, False), MAX_IMAGE_PIXELS, "photo")
        diff = np.abs(drafted - exact)
        rows.append(
            {
                "size": f"{width}x{height}",
                "megapixels": round(width * height / 1e6, 1),
                "jpeg_kb": round(len(data) / 1e3, 1),
                "exact_ms": round(exact_ms, 2),
                "draft_ms": round(draft_ms, 2),
                "speedup": round(exact_ms / draft_ms, 2),
                "mean_abs_levels": round(float(diff.mean()), 3),
                "p99_abs_levels": float(np.percentile(diff, 99)),
                "max_abs_levels": float(diff.max()),
            }
        )
    host = hostinfo.describe()
    lines = [
        "# JPEG draft decoding: TorchServe's image_classifier transforms on phone-sized photos",
        "",
        f"Host: {host['cpu']}, {host['cores']} cores, {host['allocator']}, torch {host['torch']}; one thread; "
        f"best of {args.repeats}.",
        "",
        "| photo | MP | JPEG KB | exact ms | draft ms | exact / draft | mean abs diff (levels) | p99 | max |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['size']} | {r['megapixels']} | {r['jpeg_kb']} | {r['exact_ms']} | {r['draft_ms']} | "
            f"{r['speedup']} | {r['mean_abs_levels']} | {r['p99_abs_levels']:g} | {r['max_abs_levels']:g} |"
        )
    md = "\n".join(lines)
    if args.out is not None:
        common.write_results(args.out, {"host": host, "repeats": args.repeats, "photos": rows}, md)
    print(md)


if __name__ == "__main__":
    main()
