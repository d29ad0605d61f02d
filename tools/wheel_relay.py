"""Carry a jax release to a GPU machine that has no network, in parts small enough for the link.

  python -m tools.wheel_relay pack --jax 0.12.0.1             # here: download, split into .relay/aa, ab, ...
  python3 -m tools.wheel_relay take                            # there, once per part carried: keep it in .parts/
  python3 -m tools.wheel_relay install --target /tmp/site      # there, with the last part: join, check, install
  PYTHONPATH=/tmp/site python3 -m bench.gpu                    # that jax in front of the machine's own

Why: the GPU machines lent to this project have jax 0.11.2 and no network, and a call to them
carries at most 64 MiB beside the checkout. jax 0.12.0.1 for CUDA 13 is four wheels of 233 MB (jax
3.5, jaxlib 86.8, jax-cuda13-plugin 8.2, jax-cuda13-pjrt 134.9; recompressing gains nothing, they
are zip files already). `pack` downloads them with pip for CPython 3.12 on manylinux x86-64, puts
them in one tar and splits it into parts of --part-mb (default 60 MB: four parts), each in its own
folder with a manifest (the sha256 of every part; the whole's names the pack), and adds the folders to
.git/info/exclude so that no call carries them unasked. Each call then carries one part folder
(`carry: [".relay/aa"]`); a warm machine keeps ignored files between calls, so the calls must come
back to back (it is released after 30 s idle, and a fresh one has lost the parts). `take` checks
each part against the manifest as it keeps it; `install` names any missing one, joins them and installs
the wheels with pip (--no-index --no-deps) into --target, which PYTHONPATH puts in front of the
machine's own jax and CUDA plugin. The plugin's CUDA requirements (nvidia-* wheels) for 0.12 are
0.11.2's, which that machine has.

By hand because the steps are coreutils' (split, cat, sha256sum) and pip's, tied to a link with a
size limit that no packaging tool knows of; the standard library only, so it runs under the GPU
machine's python3 before anything is installed. The same parts serve any offline machine.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import string
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from cli import run_cli
from configs import ConfigError
from configs.parser import Parser

MANIFEST = "manifest.json"
PLATFORMS = ("manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
NAMES = [a + b for a in string.ascii_lowercase for b in string.ascii_lowercase]  # aa, ab, ... as split(1) names


def pip(argv: list[str], failure: str) -> None:
    """Run this Python's pip; a failure is one ConfigError line: `failure` and pip's last line."""
    done = subprocess.run([sys.executable, "-m", "pip", *argv], capture_output=True, text=True)
    if done.returncode:
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise ConfigError(f"{failure}: {last}")


def download(version: str, cuda: str, python: str, extra: list[str], into: Path) -> list[Path]:
    """jax, jaxlib and the CUDA plugin and PJRT wheels of `version`, and the `extra` requirements,
    for CPython `python` on x86-64."""
    packages = [f"{p}=={version}" for p in ("jax", "jaxlib", f"jax-cuda{cuda}-plugin", f"jax-cuda{cuda}-pjrt")] + extra
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    flags = " ".join([f"--jax {version} --cuda {cuda}", *(f"--extra {e}" for e in extra)])
    pip(["download", "-q", "--no-deps", "--only-binary=:all:", "--python-version", python, "--implementation", "cp",
         *platforms, "-d", str(into), *packages], f"{flags}: pip download failed")
    return sorted(into.glob("*.whl"))


def pack(wheels: list[Path], relay: Path, part_bytes: int) -> dict:
    """Tar `wheels`, split the tar into relay/<name>/part.<name> of at most part_bytes each, and
    write the manifest beside every part. Returns the manifest."""
    if relay.exists() and any(relay.iterdir()) and not (relay / "aa" / MANIFEST).exists():
        raise ConfigError(f"--dir {relay}: exists and holds no earlier pack; name a new folder")
    with tempfile.TemporaryDirectory() as tmp:
        joined = Path(tmp) / "wheels.tar"
        with tarfile.open(joined, "w") as tar:
            for w in wheels:
                tar.add(w, arcname=w.name)
        size = joined.stat().st_size
        if -(-size // part_bytes) > len(NAMES):
            raise ConfigError(f"--part-mb {part_bytes / 1e6:g}: {size / 1e6:.1f} MB would make more than "
                              f"{len(NAMES)} parts; take larger parts")
        shutil.rmtree(relay, ignore_errors=True)  # an earlier pack's parts: replaced whole, no stale part survives
        parts, whole = [], hashlib.sha256()
        with joined.open("rb") as f:
            while chunk := f.read(part_bytes):
                name = NAMES[len(parts)]
                (relay / name).mkdir(parents=True)
                (relay / name / f"part.{name}").write_bytes(chunk)
                parts.append({"name": name, "bytes": len(chunk), "sha256": hashlib.sha256(chunk).hexdigest()})
                whole.update(chunk)
    manifest = {"wheels": [w.name for w in wheels], "bytes": size, "sha256": whole.hexdigest(), "parts": parts}
    for p in parts:
        (relay / p["name"] / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return manifest


def exclude(*folders: Path) -> None:
    """Add /folder/ to this checkout's .git/info/exclude (once each), so no call carries it unasked;
    folders outside the current directory travel with no call anyway."""
    info = Path(".git/info")
    if not info.parent.is_dir():
        return  # not a checkout's root: nothing travels from here
    inside = []
    for folder in folders:
        try:
            inside.append(f"/{folder.resolve().relative_to(Path.cwd().resolve()).as_posix()}/")
        except ValueError:
            continue
    info.mkdir(exist_ok=True)
    path = info / "exclude"
    lines = path.read_text().splitlines() if path.exists() else []
    path.write_text("\n".join(lines + [line for line in inside if line not in lines]) + "\n")


def take(relay: Path, parts: Path) -> tuple[dict, list[str]]:
    """Copy the parts under relay/ into parts/, each checked against its manifest. Returns the
    manifest and the names of the parts still missing."""
    manifests = sorted(relay.glob(f"*/{MANIFEST}")) + sorted(parts.glob(MANIFEST))
    if not manifests:
        raise ConfigError(f"no part under {relay}/ or {parts}/: carry a part folder (carry: [\"{relay}/aa\"])")
    manifest = json.loads(manifests[0].read_text())
    if any(json.loads(m.read_text())["sha256"] != manifest["sha256"] for m in manifests[1:]):
        raise ConfigError(f"{relay}/ and {parts}/ hold parts of different packs: carry one pack's parts only")
    parts.mkdir(parents=True, exist_ok=True)
    (parts / MANIFEST).write_text(json.dumps(manifest, indent=1))
    for p in manifest["parts"]:
        carried, kept = relay / p["name"] / f"part.{p['name']}", parts / f"part.{p['name']}"
        if carried.exists() and not kept.exists():
            with carried.open("rb") as f:
                damaged = hashlib.file_digest(f, "sha256").hexdigest() != p["sha256"]
            if damaged:
                raise ConfigError(f"{carried}: damaged (its sha256 is not the manifest's); pack again")
            shutil.copyfile(carried, kept)
    return manifest, [p["name"] for p in manifest["parts"] if not (parts / f"part.{p['name']}").exists()]


def install(manifest: dict, parts: Path, target: Path) -> None:
    """Join the parts (each checked by `take`) and pip install their wheels into target."""
    with tempfile.TemporaryDirectory() as tmp:
        joined = Path(tmp) / "wheels.tar"
        with joined.open("wb") as out:
            for p in manifest["parts"]:
                out.write((parts / f"part.{p['name']}").read_bytes())
        with tarfile.open(joined) as tar:
            tar.extractall(tmp, filter="data")
        pip(["install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir", "--upgrade", "--target",
             str(target), *(str(Path(tmp) / w) for w in manifest["wheels"])], f"pip install into {target} failed")


def main(argv: list[str]) -> int:
    p = Parser(__doc__)
    p.add_argument("action", choices=("pack", "take", "install"))
    p.add_argument("--jax", default="0.12.0.1", help="pack: the jax version (default 0.12.0.1)")
    p.add_argument("--cuda", default="13", help="pack: the CUDA major of the plugin wheels (default 13)")
    p.add_argument("--python", default="3.12", help="pack: the GPU machine's Python (default 3.12)")
    p.add_argument("--extra", action="append", default=[], metavar="NAME==VERSION",
                   help="pack: one more requirement to carry, e.g. flax==0.12.12 where the machine's is too old "
                   "for that jax (repeatable)")
    p.add_argument("--wheels", type=Path, help="pack: wheels already downloaded, in this folder, instead of pip's")
    p.add_argument("--part-mb", type=float, default=60.0, help="pack: MB per part (default 60: under 64 MiB "
                   "with a checkout of a few MB beside it)")
    p.add_argument("--dir", type=Path, default=Path(".relay"), help="the part folders (default .relay)")
    p.add_argument("--parts", type=Path, default=Path(".parts"), help="take/install: where parts are kept "
                   "between calls (default .parts)")
    p.add_argument("--target", type=Path, default=Path("/tmp/site"), help="install: pip's --target (default /tmp/site)")
    args = p.parse_args(argv)
    if args.action == "pack":
        if args.part_mb <= 0:
            raise ConfigError(f"--part-mb {args.part_mb}: must be > 0")
        with tempfile.TemporaryDirectory() as tmp:
            if args.wheels:
                wheels = sorted(args.wheels.glob("*.whl"))
            else:
                wheels = download(args.jax, args.cuda, args.python, args.extra, Path(tmp))
            if not wheels:
                raise ConfigError(f"--wheels {args.wheels}: no .whl file there")
            manifest = pack(wheels, args.dir, int(args.part_mb * 1e6))
        exclude(args.dir, args.parts)
        names = [q["name"] for q in manifest["parts"]]
        print(f"packed {len(manifest['wheels'])} wheels, {manifest['bytes'] / 1e6:.1f} MB, into {len(names)} parts "
              f"under {args.dir}/. Device calls, back to back:")
        for i, name in enumerate(names, 1):
            command = ("python3 -m tools.wheel_relay take" if i < len(names) else
                       f"python3 -m tools.wheel_relay install --target {args.target} && PYTHONPATH={args.target} ...")
            print(f"  {i}. carry [\"{args.dir}/{name}\"]  command: {command}")
        return 0
    manifest, missing = take(args.dir, args.parts)
    have = len(manifest["parts"]) - len(missing)
    if args.action == "take":
        print(f"{have} of {len(manifest['parts'])} parts kept in {args.parts}/"
              + (f"; still to carry: {', '.join(missing)}" if missing else "; all here: run install"))
        return 0
    if missing:
        raise ConfigError(f"parts {', '.join(missing)} missing from {args.parts}/: carry each in a call to this "
                          "same warm machine first (a machine idle for 30 s is released, and a fresh one has none)")
    install(manifest, args.parts, args.target)
    print(f"installed {', '.join(manifest['wheels'])} into {args.target}: run with PYTHONPATH={args.target}")
    return 0


if __name__ == "__main__":
    run_cli(main)
