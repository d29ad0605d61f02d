"""tools/wheel_relay.py: a wheel split into parts, carried one part a call, joined, checked and
installed; missing and damaged parts named."""

import base64
import hashlib
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from configs import ConfigError
from tools.wheel_relay import main


def make_wheel(folder: Path) -> Path:
    """A pure-Python wheel of 'relaytest' 1.0 with an incompressible 6 kB file, so it spans parts."""
    files = {"relaytest/__init__.py": b"VALUE = 42\n", "relaytest/noise.bin": os.urandom(6000),
             "relaytest-1.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: relaytest\nVersion: 1.0\n",
             "relaytest-1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                              b"Tag: py3-none-any\n"}

    def record_line(name: str, data: bytes) -> str:
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        return f"{name},sha256={digest},{len(data)}"

    record = "\n".join([record_line(n, d) for n, d in files.items()] + ["relaytest-1.0.dist-info/RECORD,,"]) + "\n"
    wheel = folder / "relaytest-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in files.items():
            z.writestr(name, data)
        z.writestr("relaytest-1.0.dist-info/RECORD", record)
    return wheel


@pytest.fixture
def packed(tmp_path, monkeypatch, capsys):
    """A checkout (tmp_path, with .git/info) holding a pack of the test wheel in 3 kB parts; what
    pack printed in pack.out beside it."""
    (tmp_path / "wheels").mkdir()
    make_wheel(tmp_path / "wheels")
    (tmp_path / ".git" / "info").mkdir(parents=True)
    (tmp_path / ".git" / "info" / "exclude").write_text("# git's own comment\n/.venv/\n")
    monkeypatch.chdir(tmp_path)
    assert main(["pack", "--wheels", "wheels", "--part-mb", "0.003"]) == 0
    (tmp_path / "pack.out").write_text(capsys.readouterr().out)
    return tmp_path


def test_pack_splits_into_parts_with_a_manifest_each_and_ignores_them(packed):
    relay = packed / ".relay"
    names = sorted(p.name for p in relay.iterdir())
    assert names == ["aa", "ab", "ac", "ad"], names  # tar pads to 10,240 bytes: 3,000-byte parts
    manifest = json.loads((relay / "aa" / "manifest.json").read_text())
    assert manifest["wheels"] == ["relaytest-1.0-py3-none-any.whl"]
    sizes = [(relay / n / f"part.{n}").stat().st_size for n in names]
    assert sizes == [3000, 3000, 3000, 1240] and manifest["bytes"] == 10240
    assert all(json.loads((relay / n / "manifest.json").read_text()) == manifest for n in names)
    exclude = (packed / ".git" / "info" / "exclude").read_text().splitlines()
    assert exclude == ["# git's own comment", "/.venv/", "/.relay/", "/.parts/"]
    out = (packed / "pack.out").read_text()
    assert '4. carry [".relay/ad"]  command: python3 -m tools.wheel_relay install --target /tmp/site' in out

    assert main(["pack", "--wheels", "wheels", "--part-mb", "0.004"]) == 0  # a new pack replaces the old whole
    assert sorted(p.name for p in relay.iterdir()) == ["aa", "ab", "ac"]
    assert (packed / ".git" / "info" / "exclude").read_text().count("/.relay/") == 1
    assert main(["pack", "--wheels", "wheels", "--dir", str(packed / "sub" / "relay")]) == 0  # absolute, inside
    assert main(["pack", "--wheels", "wheels", "--dir", str(packed.parent / f"{packed.name}-out")]) == 0  # outside
    exclude = (packed / ".git" / "info" / "exclude").read_text().splitlines()
    assert exclude == ["# git's own comment", "/.venv/", "/.relay/", "/.parts/", "/sub/relay/"]
    with pytest.raises(ConfigError, match="--dir wheels: exists and holds no earlier pack"):
        main(["pack", "--wheels", "wheels", "--dir", "wheels"])
    with pytest.raises(ConfigError, match=r"--part-mb 1e-05: 0.0 MB would make more than 676 parts"):
        main(["pack", "--wheels", "wheels", "--part-mb", "0.00001"])
    assert sorted(p.name for p in relay.iterdir()) == ["aa", "ab", "ac"]  # the refused pack left the last one be
    (packed / "empty").mkdir()
    assert main(["pack", "--wheels", "wheels", "--dir", "empty"]) == 0  # an empty folder is a new one


def test_parts_carried_one_a_call_install_and_import(packed, tmp_path_factory, capsys, monkeypatch):
    """As on the GPU machine: each call brings one part folder, the earlier ones kept in .parts/;
    install refuses until all are there, then the wheel imports from --target."""
    device = tmp_path_factory.mktemp("device")
    target = device / "site"
    for i, name in enumerate(["aa", "ab", "ac"]):
        carried = device / ".relay" / name
        carried.mkdir(parents=True)
        for f in (packed / ".relay" / name).iterdir():
            carried.joinpath(f.name).write_bytes(f.read_bytes())
        monkeypatch.chdir(device)
        assert main(["take"]) == 0
        assert f"{i + 1} of 4 parts kept in .parts/" in capsys.readouterr().out
        (carried / f"part.{name}").unlink()  # the next call carries only its own part
    with pytest.raises(ConfigError, match=r"parts ad missing from \.parts/"):
        main(["install", "--target", str(target)])
    (device / ".relay" / "ad").mkdir()
    for f in (packed / ".relay" / "ad").iterdir():
        (device / ".relay" / "ad" / f.name).write_bytes(f.read_bytes())
    assert main(["install", "--target", str(target)]) == 0
    assert f"installed relaytest-1.0-py3-none-any.whl into {target}" in capsys.readouterr().out
    done = subprocess.run([sys.executable, "-c", "import relaytest; print(relaytest.VALUE)"],
                          env={**os.environ, "PYTHONPATH": str(target)}, capture_output=True, text=True, cwd=device)
    assert done.stdout.strip() == "42", done.stderr


def test_a_damaged_part_is_named(packed, monkeypatch):
    part = packed / ".relay" / "ab" / "part.ab"
    data = bytearray(part.read_bytes())
    data[100] ^= 0xFF
    part.write_bytes(bytes(data))
    with pytest.raises(ConfigError, match=r"\.relay/ab/part\.ab: damaged"):
        main(["install"])
    monkeypatch.chdir(packed / "wheels")
    with pytest.raises(ConfigError, match="no part under"):
        main(["take"])
