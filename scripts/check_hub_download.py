#!/usr/bin/env python3
"""Checks `lora-train download` against the real Hugging Face Hub, which CI cannot reach.

Needs network access to the Hub (or HF_ENDPOINT's mirror) and `pip install huggingface_hub`.

    cargo build --release
    python3 scripts/check_hub_download.py [REPO] [--bin target/release/lora-train]

REPO defaults to HuggingFaceTB/SmolLM2-135M (a public Llama, one 270 MB safetensors file).
In a fresh HF_HOME it
  1. kills a `lora-train download REPO` once the weights are partly on disk, and runs it again:
     the second run must resume (it says "resuming at byte N");
  2. checks every downloaded file against the Hub's own listing (size, and sha256 for LFS
     files, whose blob is named by it);
  3. has huggingface_hub, offline, resolve every file to the same snapshot paths (the cache is
     shared with Python);
  4. runs `lora-train download` again with HF_HUB_OFFLINE=1.
Prints one line per check and exits 1 if any failed. HF_TOKEN is passed through (gated models).
"""

import argparse
import hashlib
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from huggingface_hub import HfApi, hf_hub_download, snapshot_download

failed = []


def check(ok, what):
    print(("PASS " if ok else "FAIL ") + what, flush=True)
    if not ok:
        failed.append(what)


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("repo", nargs="?", default="HuggingFaceTB/SmolLM2-135M")
    ap.add_argument("--bin", default="target/release/lora-train")
    ap.add_argument("--revision", default="main")
    a = ap.parse_args()
    home = Path(tempfile.mkdtemp(prefix="hf-check-"))
    env = dict(os.environ, HF_HOME=str(home))
    for k in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HUB_OFFLINE"):
        env.pop(k, None)
    cmd = [a.bin, "download", a.repo, "--revision", a.revision]
    blobs = home / "hub" / ("models--" + a.repo.replace("/", "--")) / "blobs"

    # 1. Interrupt the download once an .incomplete file holds some bytes, then resume.
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    t0, cut = time.time(), 0
    while p.poll() is None and time.time() - t0 < 600:
        parts = list(blobs.glob("*.incomplete")) if blobs.is_dir() else []
        if parts and parts[0].stat().st_size > 1 << 20:
            p.kill()
            p.wait()
            cut = parts[0].stat().st_size
            break
        time.sleep(0.05)
    check(cut > 0, f"interrupted the first download with {cut} bytes on disk")
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    print(r.stderr, end="")
    check(r.returncode == 0, "the second `lora-train download` succeeded")
    check("resuming at byte" in r.stderr, "it resumed the partial file")
    snap = Path(r.stdout.strip().splitlines()[-1]) if r.stdout.strip() else home
    token = os.environ.get("HF_TOKEN")
    check(not token or token not in r.stdout + r.stderr, "the token is not printed")

    # 2. Sizes and hashes against the Hub's listing.
    info = HfApi().model_info(a.repo, revision=a.revision, files_metadata=True)
    check(snap.name == info.sha, f"snapshot {snap.name} is commit {info.sha}")
    remote = {s.rfilename: s for s in info.siblings}
    files = sorted(p for p in snap.rglob("*") if p.is_file())
    check(len(files) >= 2, f"{len(files)} files in {snap}")
    for f in files:
        name = f.relative_to(snap).as_posix()
        s = remote.get(name)
        if s is None:
            check(False, f"{name} is not in the Hub's listing")
            continue
        check(f.stat().st_size == s.size, f"{name}: {f.stat().st_size} bytes, Hub says {s.size}")
        if s.lfs is not None:
            digest = sha256(f)
            check(digest == s.lfs.sha256, f"{name}: sha256 {digest[:12]}… as the Hub's")
            check(f.resolve().name == digest, f"{name}: blob named by its sha256")

    # 3. Python's huggingface_hub reads the same cache offline.
    # (huggingface_hub reads HF_HOME / HF_HUB_OFFLINE at import: pass them as arguments.)
    offline = dict(revision=a.revision, cache_dir=home / "hub", local_files_only=True)
    got = snapshot_download(a.repo, **offline)
    check(Path(got) == snap, f"huggingface_hub finds the snapshot offline: {got}")
    for f in files:
        name = f.relative_to(snap).as_posix()
        check(Path(hf_hub_download(a.repo, name, **offline)) == f, f"{name} resolves")

    # 4. And so do we.
    r = subprocess.run(cmd, env=dict(env, HF_HUB_OFFLINE="1"), capture_output=True, text=True)
    check(r.returncode == 0 and r.stdout.strip() == str(snap), "HF_HUB_OFFLINE=1 download")

    print(f"{len(failed)} failed" if failed else "all passed", f"(cache: {home})")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
