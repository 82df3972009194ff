"""benchmarks/soak.py's short mode: a few seconds of the random mix, every check passing; and the
soak's checks themselves catch a planted leak and a planted wrong token."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import soak  # noqa: E402

from mtpkit.engine.kv_pools import KVPools  # noqa: E402


def test_short_soak_passes(capsys):
    assert soak.main(["--seconds", "4", "--seed", "1"]) == 0
    out = capsys.readouterr().out
    assert "every check passed" in out and " 0 calls" not in out, out


def test_soak_catches_a_leaked_block(monkeypatch, capsys):
    release = KVPools.release

    def leaky(self, tables):   # keeps the first table's blocks
        return release(self, tables[1:]) if len(tables) > 1 else None
    monkeypatch.setattr(KVPools, "release", leaky)
    assert soak.main(["--seconds", "30", "--families", "tiny-qwen3-next"]) == 1
    assert "leaked" in capsys.readouterr().out


def test_soak_catches_a_wrong_token(monkeypatch, capsys):
    reference = soak.Soak.reference

    def off_by_one(self, *a):
        return [t + 1 for t in reference(self, *a)]
    monkeypatch.setattr(soak.Soak, "reference", off_by_one)
    assert soak.main(["--seconds", "30", "--families", "tiny-gemma4"]) == 1
    assert "!= reference" in capsys.readouterr().out
