"""A picture of one part of a report.html, for the docs: the page from one `<h2>` heading to the
next, with the page's own style and images, rendered by a real headless Chromium.

    python scripts/report_part.py REPORT.html "Where the gap comes from" docs/figures/NAME.png

The part is written beside the report (`part.html`, so its images resolve) and shot at 1,280
pixels wide, the height the part's length needs, then trimmed of the blank rows below it.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
from PIL import Image

WIDTH = 1280


def part(html: str, heading: str) -> str:
    """The page's head and the body from `<h2>heading` up to the next `<h2>`."""
    start = html.find(f"<h2>{heading}")
    if start < 0:
        sys.exit(f"no <h2>{heading} in the report")
    end = html.find("<h2>", start + 4)
    head = re.search(r"(?s)^.*?<body[^>]*>", html)
    return (head.group(0) if head else "<html><body>") + html[start:end if end > 0 else None] \
        + "</body></html>"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("report", type=Path)
    ap.add_argument("heading")
    ap.add_argument("out", type=Path)
    ap.add_argument("--height", type=int, default=6000, help="the page's height before trimming")
    a = ap.parse_args()
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        sys.exit("needs chromium (apt-get install chromium)")
    page = a.report.parent / "part.html"
    page.write_text(part(a.report.read_text(), a.heading))
    shot = a.out.with_suffix(".full.png")
    subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu",
                    "--hide-scrollbars", f"--screenshot={shot}",
                    f"--window-size={WIDTH},{a.height}", page.resolve().as_uri()],
                   check=True, capture_output=True, timeout=120)
    img = Image.open(shot).convert("RGB")
    rows = np.asarray(img).min(axis=(1, 2)) < 250   # rows with anything darker than the page
    last = int(np.nonzero(rows)[0].max()) + 24 if rows.any() else img.height
    img.crop((0, 0, WIDTH, min(last, img.height))).save(a.out, optimize=True)
    shot.unlink()
    print(f"{a.out}: {WIDTH} x {min(last, img.height)}")


if __name__ == "__main__":
    main()
