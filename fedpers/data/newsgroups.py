"""§7 on real text: prompts built from the 200 20-Newsgroups posts that ship in gensim's wheel.

The only offline copy of 20 Newsgroups found in a package is ``gensim/test/test_data/mini_newsgroup``
(a zlib-compressed Python-2 pickle of a scikit-learn ``Bunch``: 200 posts from alt.atheism and
sci.space). It needs the optional ``text`` extra (``pip install 'fedpers[text]'``: gensim and
scikit-learn); nothing else in fedpers depends on it.

How a post becomes a token (one (x, y) pair):

- the post's body (headers up to the first blank line removed);
- x = its top-D TF-IDF scores (scikit-learn ``TfidfVectorizer``, English stop words removed,
  fitted on the training posts only), sorted in decreasing order, zero-padded if the post has
  fewer than D terms, then scaled to unit norm (the model's tokens lie on the sphere);
- y = its length in tokens (scikit-learn's default token pattern), standardised with the
  training posts' mean and standard deviation.

How prompts are formed from so few posts: the posts are split once (by the seed) into a
training pool (80%) and a test pool (20%). A prompt is L+1 distinct posts drawn uniformly
without replacement from one pool; the last is the query. Prompts therefore share posts: with
N = 822 prompts of 31 posts from 160 training posts, each post appears in ~160 prompts. The
privacy unit is still one prompt, so the guarantee protects a prompt, not a post (a post is
protected only as a group of the prompts that contain it). The feature map (vocabulary, IDF
weights, length mean and sd) is fitted on the training posts and treated as public.
"""

from __future__ import annotations

import io
import pickle
import re
import zlib
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch

from fedpers.data.prompts import BLOCK, generator

Tensor = torch.Tensor
TRAIN_FRACTION = 0.8
TOKEN = re.compile(r"(?u)\b\w\w+\b")
MISSING = (
    "data=newsgroups needs the optional 'text' extra (gensim and scikit-learn): "
    "pip install 'fedpers[text]'  (or: pip install gensim scikit-learn)"
)


class _BunchUnpickler(pickle.Unpickler):
    """Loads only what the file holds (a Bunch of lists, strings and numpy arrays); refuses anything else."""

    ALLOWED: ClassVar[set[tuple[str, str]]] = {
        ("copy_reg", "_reconstructor"),
        ("copyreg", "_reconstructor"),
        ("__builtin__", "dict"),
        ("builtins", "dict"),
        ("__builtin__", "object"),
        ("builtins", "object"),
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
    }

    def find_class(self, module: str, name: str):
        if name == "Bunch" and module.startswith("sklearn"):
            return dict
        if (module, name) == ("numpy.core.multiarray", "_reconstruct"):
            import importlib

            try:  # numpy 2 renamed numpy.core to numpy._core (the old name warns)
                return importlib.import_module("numpy._core.multiarray")._reconstruct
            except ImportError:
                return importlib.import_module("numpy.core.multiarray")._reconstruct
        if (module, name) in self.ALLOWED:
            if module == "__builtin__":
                module = "builtins"
            if module == "copy_reg":
                module = "copyreg"
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"mini_newsgroup: refusing to load {module}.{name}")


def corpus_path() -> Path:
    try:
        import gensim
    except ImportError:
        raise ValueError(MISSING) from None
    path = Path(gensim.__file__).parent / "test" / "test_data" / "mini_newsgroup"
    if not path.is_file():
        raise ValueError(f"data=newsgroups: this gensim ({gensim.__version__}) has no {path}; {MISSING}")
    return path


@lru_cache(maxsize=1)
def load_posts() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(post bodies, newsgroup names) of the 200 posts, in file order."""
    raw = zlib.decompress(corpus_path().read_bytes())
    bunch = _BunchUnpickler(io.BytesIO(raw), encoding="latin1").load()
    texts = [t.decode("latin1") if isinstance(t, bytes) else str(t) for t in bunch["data"]]
    names = [str(bunch["target_names"][int(i)]) for i in bunch["target"]]
    bodies = [t.split("\n\n", 1)[1] if "\n\n" in t else t for t in texts]
    return tuple(bodies), tuple(names)


@dataclass(frozen=True)
class TextTokens:
    """Every post as a token: x (posts, D) unit vectors, y (posts,) standardised lengths, and the split."""

    x: Tensor
    y: Tensor
    train: Tensor
    test: Tensor
    length_mean: float
    length_sd: float


@lru_cache(maxsize=8)
def text_tokens(dim: int, seed: int) -> TextTokens:
    try:
        from sklearn.feature_extraction.text import TfidfVectorizer
    except ImportError:
        raise ValueError(MISSING) from None
    bodies, _ = load_posts()
    rng = np.random.default_rng(np.random.SeedSequence([int(seed), 7]))
    perm = rng.permutation(len(bodies))
    n_train = round(TRAIN_FRACTION * len(bodies))
    train, test = np.sort(perm[:n_train]), np.sort(perm[n_train:])
    vec = TfidfVectorizer(stop_words="english")
    vec.fit([bodies[i] for i in train])
    scores = vec.transform(bodies).toarray()
    top = -np.sort(-scores, axis=1)[:, :dim]
    if top.shape[1] < dim:
        top = np.pad(top, ((0, 0), (0, dim - top.shape[1])))
    norms = np.linalg.norm(top, axis=1, keepdims=True)
    keep = norms[:, 0] > 0
    x = np.where(keep[:, None], top / np.where(norms > 0, norms, 1.0), 0.0)
    lengths = np.array([len(TOKEN.findall(b)) for b in bodies], dtype=np.float64)
    mean, sd = float(lengths[train].mean()), float(lengths[train].std())
    y = (lengths - mean) / sd
    train, test = train[keep[train]], test[keep[test]]
    return TextTokens(
        torch.from_numpy(x), torch.from_numpy(y), torch.from_numpy(train), torch.from_numpy(test), mean, sd
    )


def _assemble(tokens: TextTokens, pool: Tensor, picks: Tensor) -> tuple[Tensor, Tensor]:
    posts = pool[picks]
    return tokens.x[posts], tokens.y[posts]


def _pick(g: torch.Generator, shape: tuple[int, ...], pool_size: int, context: int, dtype: torch.dtype) -> Tensor:
    if context + 1 > pool_size:
        raise ValueError(f"context L={context} needs L+1 distinct posts per prompt; the pool has only {pool_size}")
    return torch.rand(*shape, pool_size, generator=g, dtype=dtype).argsort(-1)[..., : context + 1]


def text_prompts_by_id(
    seed: int, stream: int, ids: Tensor, context: int, dim: int, test: bool = False
) -> tuple[Tensor, Tensor]:
    """Prompts with the given ids (train or test pool); prompt k depends only on (seed, stream, k)."""
    tokens = text_tokens(dim, seed)
    pool = tokens.test if test else tokens.train
    ids = ids.to("cpu", torch.int64)
    picks = torch.empty(int(ids.shape[0]), context + 1, dtype=torch.int64)
    blocks = ids // BLOCK
    for blk in torch.unique(blocks).tolist():
        rows = (blocks == blk).nonzero().squeeze(1)
        block = _pick(generator(seed, stream, blk), (BLOCK,), len(pool), context, torch.float64)
        picks[rows] = block[ids[rows] - blk * BLOCK]
    return _assemble(tokens, pool, picks)


def text_prompt_batch(
    g: torch.Generator, seed: int, reps: int, n: int, context: int, dim: int, test: bool = False
) -> tuple[Tensor, Tensor]:
    """(reps, n) prompts from one generator (Monte-Carlo sweeps); the post split is fixed by ``seed``."""
    tokens = text_tokens(dim, seed)
    pool = tokens.test if test else tokens.train
    return _assemble(tokens, pool, _pick(g, (reps, n), len(pool), context, torch.float32))
