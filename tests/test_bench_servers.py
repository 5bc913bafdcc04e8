"""The benchmarks' server launcher: the environment a server runs in (another checkout, variables of its own)."""

from pathlib import Path

from bench.servers import ROOT, tree_env


def test_a_servers_own_variables_add_to_this_processs_environment(monkeypatch):
    monkeypatch.setenv("PATH", "/opt/compilers/bin:/usr/bin")
    monkeypatch.delenv("STALLFREE_KERNEL_CACHE", raising=False)
    env = tree_env(ROOT, {"STALLFREE_FAULTS": "sample:0:1000"})
    assert env["STALLFREE_FAULTS"] == "sample:0:1000"
    assert env["PATH"] == "/opt/compilers/bin:/usr/bin"  # without it the server finds no compiler
    assert "STALLFREE_KERNEL_CACHE" not in env  # this checkout: the default cache


def test_another_checkout_compiles_into_a_kernel_cache_of_its_own(tmp_path: Path):
    env = tree_env(tmp_path / "before", {"HOME": str(tmp_path)})
    assert env["STALLFREE_KERNEL_CACHE"] == str(Path.home() / ".cache" / "stallfree" / "kernels-before")
    assert env["HOME"] == str(tmp_path)
