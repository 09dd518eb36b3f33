"""Building the CPU kernels (toolkit/backends/cpu/build.py): cached per source and headers, failures
reported with the file they name, and an engine that still serves without them."""

import ctypes

import pytest

from toolkit.backends.cpu import build, kernels


def test_build_is_cached_per_source_and_reports_a_missing_compiler(tmp_path, monkeypatch):
    monkeypatch.setenv("TOOLKIT_CACHE", str(tmp_path))
    source = kernels.SOURCES["attention"]
    first = build.build(source)
    assert first.parent == tmp_path / "kernels" and first.exists()
    mtime = first.stat().st_mtime_ns
    assert build.build(source) == first and first.stat().st_mtime_ns == mtime  # not rebuilt
    assert [p.name for p in first.parent.iterdir()] == [first.name]  # no temporary files left behind
    with pytest.raises(build.BuildError, match="no C\\+\\+ compiler 'no-such-compiler-xyz'.*attention.cpp"):
        build.build(source, compiler="no-such-compiler-xyz")


def test_a_changed_local_header_rebuilds_the_kernel(tmp_path, monkeypatch):
    monkeypatch.setenv("TOOLKIT_CACHE", str(tmp_path))
    (tmp_path / "inner.h").write_text("inline int value() { return 1; }\n")
    (tmp_path / "outer.h").write_text('#include "inner.h"\n')  # headers including headers count too
    source = tmp_path / "uses_header.cpp"
    source.write_text('#include "outer.h"\nextern "C" int f() { return value(); }\n')
    first = build.build(source)
    assert ctypes.CDLL(str(first)).f() == 1
    (tmp_path / "inner.h").write_text("inline int value() { return 2; }\n")
    second = build.build(source)
    assert second != first and ctypes.CDLL(str(second)).f() == 2


def test_a_missing_source_or_header_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv("TOOLKIT_CACHE", str(tmp_path))
    with pytest.raises(build.BuildError, match="nowhere.cpp is missing: the installed package is incomplete"):
        build.build(tmp_path / "nowhere.cpp")
    source = tmp_path / "needs.cpp"
    source.write_text('#include "gone.h"\n')
    with pytest.raises(build.BuildError, match="needs.cpp includes gone.h, which is missing"):
        build.build(source)


def test_build_all_returns_each_result_and_keeps_going(tmp_path, monkeypatch):
    monkeypatch.setenv("TOOLKIT_CACHE", str(tmp_path))
    broken = tmp_path / "broken.cpp"
    broken.write_text("this is not C++\n")
    fine = tmp_path / "fine.cpp"
    fine.write_text('extern "C" int f() { return 0; }\n')
    results = build.build_all([broken, fine])
    assert isinstance(results[broken], build.BuildError) and "broken.cpp failed" in str(results[broken])
    assert results[fine].exists()


def test_kernels_build_once_each_and_load_waits_only_for_the_ones_asked(monkeypatch):
    """start_build (the CLI's, then the engine's) starts each kernel once; load waits for and reports
    only the kernels it is asked for."""
    built = []
    monkeypatch.setattr(build, "build_or_error",
                        lambda source: built.append(source.stem) or build.BuildError(f"{source.name}: no compiler"))
    for name in ("_loaded", "_failed", "_building"):
        monkeypatch.setattr(kernels, name, {})
    kernels.start_build(("linear", "attention"))
    kernels.start_build(("linear",))
    with pytest.warns(RuntimeWarning, match="linear.cpp"):
        assert list(kernels.load(("linear",))) == ["linear"]
    with pytest.warns(RuntimeWarning, match="attention.cpp"):
        assert sorted(kernels.load(("linear", "attention"))) == ["attention", "linear"]
    assert sorted(built) == ["attention", "linear"] and not kernels.available("linear")


def test_an_engine_without_the_kernels_warns_naming_them_and_still_matches_transformers(tmp_path, monkeypatch):
    """No compiler: one warning per kernel naming its source, and torch's own ops serve the model."""
    from tests.checkpoints import hf_greedy, random_prompts, write_checkpoint
    from toolkit import LLM, SamplingParams

    path = write_checkpoint(tmp_path / "model", "llama3", seed=2)
    prompts = random_prompts(3, seed=4)
    monkeypatch.setattr(kernels, "_loaded", {})
    monkeypatch.setattr(kernels, "_failed", {})
    monkeypatch.setattr(kernels, "_building", {})
    monkeypatch.setenv("CXX", "no-such-compiler-xyz")
    monkeypatch.setenv("TOOLKIT_CACHE", str(tmp_path / "cache"))
    with pytest.warns(RuntimeWarning) as caught:
        llm = LLM(str(path), dtype="float32", enforce_eager=True, max_model_len=96, skip_tokenizer_init=True)
    named = " ".join(str(w.message) for w in caught)
    assert "csrc/linear.cpp" in named and "csrc/attention.cpp" in named
    assert "csrc/experts.cpp" not in named  # a dense model's engine does not build the experts' kernel
    stats = llm.engine.stats()
    assert stats["attention_backend"] == "torch" and stats["backend"]["packed_linears"] == 0
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=10),
                        use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(path, prompts, 10)


def test_the_cpu_backend_is_refused_where_the_kernel_cannot_serve(tmp_path):
    from tests.checkpoints import write_checkpoint
    from toolkit import LLM

    path = write_checkpoint(tmp_path / "model", "llama3", seed=2)
    (path / "model.safetensors").unlink()  # the error must come before any weight is read
    with pytest.raises(ValueError, match="multiples of 8"):
        LLM(str(path), dtype="float32", attention_backend="cpu", block_size=12)
