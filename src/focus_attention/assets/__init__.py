"""Real assets for Focus, prepared once and then used offline from a cache (``FOCUS_HOME``,
default ``~/.cache/focus-attention``): pretrained causal LMs converted from GGUF packages on
PyPI (:mod:`.models`), text corpora from Debian packages or local files and folders with fixed
train/validation/test splits (:mod:`.corpora`), zero-shot benchmark data from a pinned PyPI
wheel (:mod:`.benchmarks`), and the cache plumbing they share (:mod:`.cache`). Importing this
package does not import transformers."""

from ..utils.io import focus_home
from .benchmarks import (
    BENCHMARK_DATA,
    BENCHMARKS,
    BenchmarkSpec,
    benchmark_dir,
    benchmark_files,
    list_benchmarks,
    prepare_benchmarks,
)
from .cache import MANIFEST_NAME, WheelFile, verify_entry
from .corpora import (
    AUSTEN_BOOKS,
    AUSTEN_SPLIT,
    CORPORA,
    DEFAULT_CORPUS,
    SPLITS,
    Corpus,
    CorpusSpec,
    Document,
    corpus_dir,
    list_corpora,
    load_corpus,
    prepare_corpus,
    split_by_hash_rank,
    token_blocks,
)
from .models import (
    DEFAULT_MODEL,
    MODELS,
    ModelSpec,
    auto_prepend_bos,
    is_prepared,
    list_models,
    load_model,
    model_dir,
    prepare_model,
)

__all__ = [
    "AUSTEN_BOOKS",
    "BENCHMARKS",
    "BENCHMARK_DATA",
    "AUSTEN_SPLIT",
    "CORPORA",
    "DEFAULT_CORPUS",
    "DEFAULT_MODEL",
    "MANIFEST_NAME",
    "MODELS",
    "SPLITS",
    "BenchmarkSpec",
    "Corpus",
    "CorpusSpec",
    "Document",
    "ModelSpec",
    "WheelFile",
    "auto_prepend_bos",
    "benchmark_dir",
    "benchmark_files",
    "corpus_dir",
    "focus_home",
    "is_prepared",
    "list_benchmarks",
    "list_corpora",
    "list_models",
    "load_corpus",
    "load_model",
    "prepare_benchmarks",
    "model_dir",
    "prepare_corpus",
    "prepare_model",
    "split_by_hash_rank",
    "token_blocks",
    "verify_entry",
]
