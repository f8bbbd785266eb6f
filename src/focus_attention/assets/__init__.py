"""Real assets for Focus, prepared once and then used offline from a cache (``FOCUS_HOME``,
default ``~/.cache/focus-attention``): pretrained causal LMs converted from GGUF packages on
PyPI (:mod:`.models`), text corpora from Debian packages or local files and folders with fixed
train/validation/test splits (:mod:`.corpora`), zero-shot benchmark data from a pinned PyPI
wheel (:mod:`.benchmarks`), and the cache plumbing they share (:mod:`.cache`). Each name is
imported from its module on first access (:mod:`focus_attention.utils.lazy`); none of these
modules imports torch or transformers at import time."""

from ..utils.lazy import exports_of, lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(
    __name__,
    exports_of(
        {
            "..utils.io": ("focus_home",),
            ".benchmarks": (
                "BENCHMARK_DATA",
                "BENCHMARKS",
                "BenchmarkSpec",
                "benchmark_dir",
                "benchmark_files",
                "list_benchmarks",
                "prepare_benchmarks",
            ),
            ".cache": ("MANIFEST_NAME", "WheelFile", "verify_entry"),
            ".corpora": (
                "AUSTEN_BOOKS",
                "AUSTEN_SPLIT",
                "CORPORA",
                "DEFAULT_CORPUS",
                "SPLITS",
                "Corpus",
                "CorpusSpec",
                "Document",
                "corpus_dir",
                "list_corpora",
                "load_corpus",
                "prepare_corpus",
                "split_by_hash_rank",
                "token_blocks",
            ),
            ".models": (
                "DEFAULT_MODEL",
                "MODELS",
                "ModelSpec",
                "auto_prepend_bos",
                "is_prepared",
                "list_models",
                "load_model",
                "model_dir",
                "prepare_model",
            ),
        }
    ),
)
