"""open_clip without importing transformers until a Hugging Face tower needs it.

open_clip imports transformers when its package is imported, whenever transformers is installed (its
``hf_model`` and ``coca_model`` modules), and transformers' ``AutoModel`` imports its generation
utilities and, through them, scikit-learn and SciPy. That is 0.8 s of every start on the 2-core
machine and 3.5 s on the H100 machine (2026-11-26, ``python -X importtime``), spent by every run,
sweep job and data-loader process for a tower most runs never build. So ``import_open_clip`` imports
open_clip with transformers held back (open_clip then takes it for absent), and ``load_transformers``
gives open_clip's two modules what their own ``try: from transformers import ...`` would have bound,
the first time a Hugging Face text tower is built (``HFTextEncoder.__init__``) or CoCa generates
text. A process that imported transformers or open_clip before is left as it is.

wandb is held back the same way: timm (imported by open_clip) imports it, when installed, for its own
training script's ``update_summary(log_wandb=True)``, which nothing here calls; that is 0.7 s of every
process on the 2-core machine. ``logger=wandb`` imports it itself, as usual.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import sys

_deferred = False  # open_clip was imported here with transformers held back, not given it yet

# the names open_clip's modules bind in their `try: from transformers import ...` (open_clip 3.x);
# where one is missing, the module's `except ImportError` would have run, and it is left as that left it
_HF_MODEL = ("transformers", ("AutoModel", "AutoTokenizer", "AutoConfig", "PretrainedConfig")), \
    ("transformers.modeling_outputs", ("BaseModelOutput", "BaseModelOutputWithPooling",
                                       "BaseModelOutputWithPoolingAndCrossAttentions"))
_COCA_MODEL = ("transformers", ("LogitsProcessorList", "TopPLogitsWarper", "TopKLogitsWarper",
                                "RepetitionPenaltyLogitsProcessor", "MinLengthLogitsProcessor", "MaxLengthCriteria",
                                "StopStringCriteria", "EosTokenCriteria", "StoppingCriteriaList")), \
    ("transformers.generation", ("BeamSearchScorer",))


def import_open_clip():
    """Import open_clip (once per process), transformers held back where nothing imported it yet.
    Returns the module."""
    global _deferred
    if "open_clip" in sys.modules or "transformers" in sys.modules:
        return importlib.import_module("open_clip")
    held = [name for name in ("transformers", "wandb") if name not in sys.modules]
    for name in held:
        sys.modules[name] = None  # `import <name>` raises ImportError while this is here
    try:
        import open_clip
    finally:
        for name in held:
            if sys.modules.get(name, 0) is None:
                del sys.modules[name]
    if importlib.util.find_spec("transformers") is None:
        return open_clip  # not installed: open_clip is as it would have been
    _deferred = True
    _load_first(open_clip.hf_model.HFTextEncoder, "__init__")
    _load_first(open_clip.coca_model.CoCa, "generate")
    return open_clip


def _load_first(cls: type, method: str) -> None:
    original = getattr(cls, method)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        load_transformers()
        return original(*args, **kwargs)

    setattr(cls, method, wrapper)


def _imported(names) -> dict | None:
    """``{name: object}`` for ``((module, names), ...)``, or None where one does not import."""
    try:
        return {symbol: getattr(importlib.import_module(source), symbol) for source, symbols in names
                for symbol in symbols}
    except (ImportError, AttributeError):
        return None


def load_transformers() -> None:
    """Import transformers and bind in open_clip's modules what their own imports would have bound
    (once; a no-op where ``import_open_clip`` did not hold it back)."""
    global _deferred
    if not _deferred:
        return
    _deferred = False
    import open_clip
    import transformers

    hf = _imported(_HF_MODEL)
    if hf is not None:
        vars(open_clip.hf_model).update(hf, transformers=transformers)
    coca = _imported(_COCA_MODEL)
    if coca is not None:
        vars(open_clip.coca_model).update(coca, _has_transformers=True, GENERATION_TYPES={
            "top_k": coca["TopKLogitsWarper"], "top_p": coca["TopPLogitsWarper"], "beam_search": "beam_search"})
