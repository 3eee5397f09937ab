"""scripts/check_engine_imports.py: make test-gpu's check that the installed
vLLM can start an engine before any engine is started."""

from __future__ import annotations

import check_engine_imports


def test_the_installed_wheel_imports_what_an_engine_start_imports():
    assert check_engine_imports.check() == []


def test_a_missing_module_is_named(monkeypatch):
    monkeypatch.setattr(check_engine_imports, "MODULES",
                        ("vllm.v1.engine.core", "no_such_module_for_this_test"))
    failures = check_engine_imports.check()
    assert len(failures) == 1
    assert failures[0].startswith("no_such_module_for_this_test: ModuleNotFoundError")


def test_quantization_configs_that_cannot_load_are_named(monkeypatch):
    from vllm.model_executor.layers import quantization

    def broken(method):
        raise ModuleNotFoundError("No module named 'humming'")

    monkeypatch.setattr(quantization, "get_quantization_config", broken)
    assert check_engine_imports.check() == [
        "quantization configs: ModuleNotFoundError: No module named 'humming'"]


def test_main_exits_nonzero_and_says_what_to_do(monkeypatch, capsys):
    monkeypatch.setattr(check_engine_imports, "MODULES", ("no_such_module_for_this_test",))
    assert check_engine_imports.main() == 1
    assert "make wheelhouse" in capsys.readouterr().err


def test_the_samplers_flashinfer_import_is_checked_unless_turned_off(monkeypatch):
    """An engine start on CUDA imports FlashInfer for the sampler unless
    VLLM_USE_FLASHINFER_SAMPLER=0: a wheelhouse without it passed the check
    and every engine then failed at start."""
    monkeypatch.setattr(check_engine_imports, "MODULES", ())
    monkeypatch.setattr(check_engine_imports, "SAMPLER_MODULE", "no_such_module_for_this_test")
    monkeypatch.delenv("VLLM_USE_FLASHINFER_SAMPLER", raising=False)
    failures = check_engine_imports.check()
    assert len(failures) == 1 and failures[0].startswith(
        "no_such_module_for_this_test (the sampler; VLLM_USE_FLASHINFER_SAMPLER=0 leaves it "
        "out): ModuleNotFoundError")
    monkeypatch.setenv("VLLM_USE_FLASHINFER_SAMPLER", "0")
    assert check_engine_imports.check() == []
