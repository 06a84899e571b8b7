"""Shared fixtures: a tiny random Llama with a real (small, locally trained) byte-level BPE tokenizer; and helpers
more than one test file uses (transformers' greedy reference, the interpreted Triton kernels, test certificates)."""
from __future__ import annotations

import datetime
import importlib
import ipaddress
import os
import sys
from pathlib import Path

# Triton has no CPU backend: its kernels run under the interpreter here, which must be chosen before triton is
# first imported (transformers may import it early).
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from base.tls import TlsConfig
from benchmarks.common.random_models import build_tiny_tokenizer
from benchmarks.engine.exactness import transformers_greedy  # noqa: F401 (the tests import it from here)


def import_interpreted_kernels(module: str = "kernels.triton_paged"):
    """A kernels.triton_* module as Triton's interpreter runs it: triton and every kernels.triton_* module are
    imported afresh if triton was imported before TRITON_INTERPRET was set (jit functions, triton.language's own too,
    are built at import; a sibling module left in place would keep its compiled kernels)."""
    import triton.language as tl
    from kernels import triton_launch
    if triton_launch.interpreting() and type(tl.max).__name__ == "InterpretedFunction":
        return importlib.import_module(module)
    stale = [name for name in sys.modules if name.split(".")[0] == "triton" and not name.startswith("triton._C")]
    stale += [name for name in sys.modules if name.startswith("kernels.triton_")]
    for name in stale:
        del sys.modules[name]  # the compiled extension stays: loading it twice aborts
    return importlib.import_module(module)


def build_tiny_llama(path: Path, *, tie_word_embeddings: bool = False, rope_scaling: dict | None = None,
                     num_key_value_heads: int = 2, seed: int = 0) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = build_tiny_tokenizer(path)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=num_key_value_heads, head_dim=16,
        max_position_embeddings=1024, rope_theta=10000.0, rope_scaling=rope_scaling, rms_norm_eps=1e-5,
        tie_word_embeddings=tie_word_embeddings, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, torch_dtype="float32")
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # larger weights than the default init, so greedy outputs vary with the prompt
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.15)
    model.save_pretrained(path, safe_serialization=True)
    return path


# --- certificates ------------------------------------------------------------------------------------------
def new_name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))


def certificate(subject: str, key, issuer: str, issuer_key, *, ca: bool) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(new_name(subject)).issuer_name(new_name(issuer))
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if not ca:
        names = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
        builder = (builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
                   .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                         ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False))
    return builder.sign(issuer_key, hashes.SHA256())


def make_pki(directory: Path, name: str) -> TlsConfig:
    """A CA and a certificate it signed for localhost / 127.0.0.1, serving and client use."""
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_cert = certificate(f"{name} CA", ca_key, f"{name} CA", ca_key, ca=True)
    cert = certificate("localhost", key, f"{name} CA", ca_key, ca=False)
    paths = TlsConfig(str(directory / f"{name}.pem"), str(directory / f"{name}-key.pem"),
                      str(directory / f"{name}-ca.pem"))
    Path(paths.cert).write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    Path(paths.ca).write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    write_key(Path(paths.key), key)
    return paths




@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_llama_tied_dir(tmp_path_factory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama-tied"), tie_word_embeddings=True,
                            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                          "high_freq_factor": 4.0, "original_max_position_embeddings": 256},
                            num_key_value_heads=1, seed=1)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> str:
    """The tiny byte-level BPE tokenizer alone, for routers in front of synthetic schedulers."""
    path = tmp_path_factory.mktemp("tokenizer")
    build_tiny_tokenizer(path)
    return str(path)


# --- rooms -------------------------------------------------------------------------------------------------
ROOMS = ("engine", "services", "deploy", "chaos", "benchmarks")   # tests/<room>/: beyond one package


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Under `-m quick` the rooms are not collected at all: none of their tests is quick, and importing their modules
    would take half the quick layer's collection."""
    in_a_room = collection_path.parent == Path(__file__).parent and collection_path.name in ROOMS
    return True if in_a_room and config.getoption("markexpr") == "quick" else None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test in tests/<room>/ is marked with its room; the others (tests/unit/, tests/test_layering.py) that are not
    slow are `quick`: `pytest -m quick` is the layer that runs in one process in a few minutes."""
    here = Path(__file__).parent
    for item in items:
        if not item.path.is_relative_to(here):
            continue
        room = item.path.relative_to(here).parts[0]
        if room in ROOMS:
            item.add_marker(room)
        elif item.get_closest_marker("slow") is None:
            item.add_marker("quick")
