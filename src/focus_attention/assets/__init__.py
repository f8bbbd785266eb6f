"""Real assets for Focus, prepared once and then used offline from a cache (``FOCUS_HOME``,
default ``~/.cache/focus-attention``): pretrained causal LMs converted from GGUF packages on
PyPI (:mod:`.models`; the registered ones are :mod:`.model_registry`), text corpora from
Debian packages or local files and folders with fixed train/validation/test splits
(:mod:`.corpora`) and their tokenisation into blocks (:mod:`.blocks`), zero-shot benchmark
data from a pinned PyPI wheel (:mod:`.benchmarks`), and the cache plumbing they share
(:mod:`.cache`). Each name is imported from its module on first access
(:mod:`focus_attention.utils.lazy`); loading a model (:mod:`.models`) and tokenising
(:mod:`.blocks`) import torch, the other modules import neither torch nor transformers."""

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
            ),
            ".blocks": ("token_blocks",),
            ".model_registry": (
                "DEFAULT_MODEL",
                "MODELS",
                "ModelSpec",
                "is_prepared",
                "list_models",
                "model_dir",
            ),
            ".models": ("auto_prepend_bos", "load_model", "prepare_model"),
        }
    ),
)
