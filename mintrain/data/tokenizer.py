"""Tokenizers: text <-> token ids, and what the rest of mintrain needs to know of them.

`load(data.tokenizer)` is the one place a tokenizer is made:
- 'byte': ids 0..255 are the UTF-8 bytes, then BOS (256). No vocabulary file and no training: any text
  round-trips exactly, and one token is one byte, so a loss in nats per token is one in nats per byte.
- a Hugging Face tokenizer (the `tokenizers` package): a `tokenizer.json`, or a directory holding one;
  its `tokenizer_config.json`, beside it, names BOS and EOS (and a `chat_template.jinja` there, the chat
  template `mintrain.data.chat` renders, travels with it).
- a SentencePiece model: a `.model` file, or a directory holding `tokenizer.model`.

Every tokenizer gives the same small interface (`ByteTokenizer` is the reference): `encode(text)` ids
without special tokens, `document(text)` the ids a document contributes to a packed stream (with BOS and
EOS by the tokenizer's conventions; `documents(texts)` many at once, in parallel), lenient `decode`,
`bos_id`/`eos_id`, `vocab_size` (every id is below it), `bytes_per_token` where it is fixed, and
`save(directory)`, which writes the files that `load` and transformers' `AutoTokenizer` read back.
`tokenizers` and `sentencepiece` are imported on first use.
No tokenizer needs a PAD token: padded rows (`data.packing='pad'`) mark padding in their segment ids
and target weights (`mintrain.data.segments`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
from etils import epath

from mintrain.errors import ConfigError

NUM_BYTES = 256
BOS = NUM_BYTES  # The byte tokenizer's begin-of-document; the separator between packed documents.
VOCAB_SIZE = NUM_BYTES + 1  # Ids the byte tokenizer produces.
RUN_DIR = 'tokenizer'  # A run's copy of its tokenizer's files, in its workdir (for sampling, export).
HF_FILES = ('tokenizer.json', 'tokenizer_config.json', 'special_tokens_map.json', 'chat_template.jinja')
SP_FILE = 'tokenizer.model'


def padded_vocab_size(num_ids: int = VOCAB_SIZE, multiple: int = 128) -> int:
  """`num_ids` rounded up, so the `vocab` axis splits evenly over a model axis of any size dividing it.

  The extra ids are never targets; the model learns to give them no probability.
  """
  return -(-num_ids // multiple) * multiple


def _stream_dtype(vocab_size: int) -> np.dtype:
  return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


class ByteTokenizer:
  """UTF-8 bytes plus BOS, which starts every document; packing needs no padding, so there is no PAD."""

  name = 'byte'
  vocab_size = VOCAB_SIZE
  bos_id: int | None = BOS
  eos_id: int | None = None
  bytes_per_token: float | None = 1.0  # The BOS of each document counts as a byte (~1e-4 of the stdlib).

  def encode(self, text: str) -> np.ndarray:
    """int32 (n,) ids of the UTF-8 bytes of `text`."""
    return np.frombuffer(text.encode('utf-8'), dtype=np.uint8).astype(np.int32)

  def document(self, text: str) -> np.ndarray:
    """[BOS, bytes...] in the stream's dtype."""
    raw = text.encode('utf-8')
    out = np.empty(len(raw) + 1, _stream_dtype(self.vocab_size))
    out[0] = BOS
    out[1:] = np.frombuffer(raw, np.uint8)
    return out

  def documents(self, texts: Sequence[str]) -> list[np.ndarray]:
    return [self.document(text) for text in texts]

  def decode(self, ids: Sequence[int] | np.ndarray) -> str:
    """Text of the byte ids; special and out-of-range ids are dropped, broken UTF-8 becomes U+FFFD.

    Lenient on purpose: it decodes model samples, which may hold any id of the padded vocabulary.
    """
    ids = np.asarray(ids).reshape(-1)
    data = ids[(ids >= 0) & (ids < NUM_BYTES)].astype(np.uint8)
    return data.tobytes().decode('utf-8', errors='replace')

  def save(self, directory: str | os.PathLike) -> list[str]:
    """Nothing to write: the byte tokenizer has no files."""
    return []


class _FileTokenizer:
  """What the Hugging Face and SentencePiece tokenizers share: documents, lenient decoding, saving."""

  name: str
  vocab_size: int
  bos_id: int | None
  eos_id: int | None
  bytes_per_token: float | None = None  # Depends on the text: measured on the eval split.
  files: dict[str, bytes]  # What `save` writes: file name -> contents.

  def _encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
    raise NotImplementedError

  def _decode(self, ids: list[int]) -> str:
    raise NotImplementedError

  def document(self, text: str) -> np.ndarray:
    """[BOS] + ids + [EOS] in the stream's dtype, each special token where the tokenizer has one (once,
    where BOS and EOS are the same token, as GPT-2's <|endoftext|>)."""
    return self.documents([text])[0]

  def documents(self, texts: Sequence[str]) -> list[np.ndarray]:
    """`document` of each text, encoded together (in parallel, by the tokenizer's own threads)."""
    head = [self.bos_id] if self.bos_id is not None else []
    tail = [self.eos_id] if self.eos_id is not None and self.eos_id != self.bos_id else []
    dtype = _stream_dtype(self.vocab_size)
    return [np.array(head + ids + tail, dtype) for ids in self._encode_batch(texts)]

  def decode(self, ids: Sequence[int] | np.ndarray) -> str:
    """Text of the ids without special tokens; ids outside the vocabulary (padding) are dropped."""
    ids = np.asarray(ids).reshape(-1)
    return self._decode([int(i) for i in ids[(ids >= 0) & (ids < self.vocab_size)]])

  def save(self, directory: str | os.PathLike) -> list[str]:
    """Writes the tokenizer's files into `directory` (made if missing); returns their names."""
    root = epath.Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    for name, data in self.files.items():
      (root / name).write_bytes(data)
    return sorted(self.files)


def _special_id(vocab: dict[str, int], token: Any) -> int | None:
  """The id of a tokenizer_config.json special token (a string or {'content': ...}), if any."""
  content = token.get('content') if isinstance(token, dict) else token
  return vocab.get(content) if content else None


def _template_ends(post: dict | None) -> tuple[int | None, int | None]:
  """(id before, id after) the text in the single-sequence template of a tokenizer.json post-processor."""
  if not post:
    return None, None
  if post.get('type') == 'Sequence':
    for inner in post.get('processors', []):
      ends = _template_ends(inner)
      if ends != (None, None):
        return ends
    return None, None
  if post.get('type') in ('BertProcessing', 'RobertaProcessing'):
    return post['cls'][1], post['sep'][1]
  if post.get('type') != 'TemplateProcessing':
    return None, None
  names = ['' if 'Sequence' in item else item['SpecialToken']['id'] for item in post['single']]
  text = names.index('')
  ids = {name: spec['ids'][0] for name, spec in post['special_tokens'].items()}
  return (ids[names[0]] if text > 0 else None), (ids[names[-1]] if text < len(names) - 1 else None)


class HFTokenizer(_FileTokenizer):
  """A Hugging Face `tokenizer.json`. BOS is the token its post-processor puts before the text (Llama's
  <s>, Llama 3's <|begin_of_text|>; none for GPT-2 or Qwen2), or tokenizer_config.json's bos_token
  where that says `add_bos_token`; EOS is tokenizer_config.json's eos_token, else the token the
  post-processor puts after the text."""

  def __init__(self, name: str, files: dict[str, bytes]):
    from tokenizers import Tokenizer

    self.name, self.files = name, files
    text = files['tokenizer.json'].decode('utf-8')
    self.tokenizer = Tokenizer.from_str(text)
    self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)
    vocab = self.tokenizer.get_vocab(with_added_tokens=True)
    config = json.loads(files.get('tokenizer_config.json', b'{}'))
    before, after = _template_ends(json.loads(text).get('post_processor'))
    self.bos_id = before if before is not None else (
        _special_id(vocab, config.get('bos_token')) if config.get('add_bos_token') else None)
    eos = _special_id(vocab, config.get('eos_token'))
    self.eos_id = eos if eos is not None else after

  def encode(self, text: str) -> np.ndarray:
    return np.asarray(self.tokenizer.encode(text, add_special_tokens=False).ids, np.int32)

  def _encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
    return [e.ids for e in self.tokenizer.encode_batch(list(texts), add_special_tokens=False)]

  def _decode(self, ids: list[int]) -> str:
    return self.tokenizer.decode(ids, skip_special_tokens=True)


class SentencePieceTokenizer(_FileTokenizer):
  """A SentencePiece model; its own BOS and EOS ids (either may be absent)."""

  def __init__(self, name: str, model: bytes):
    import sentencepiece

    self.name = name
    self.processor = sentencepiece.SentencePieceProcessor(model_proto=model)
    self.vocab_size = self.processor.get_piece_size()
    bos, eos = self.processor.bos_id(), self.processor.eos_id()
    self.bos_id, self.eos_id = (bos if bos >= 0 else None), (eos if eos >= 0 else None)
    # transformers' AutoTokenizer reads a SentencePiece model as LlamaTokenizer does.
    unk = self.processor.unk_id()
    config = {'tokenizer_class': 'LlamaTokenizer', 'bos_token': self._piece(self.bos_id),
              'eos_token': self._piece(self.eos_id), 'unk_token': self._piece(unk if unk >= 0 else None),
              'add_bos_token': self.bos_id is not None, 'add_eos_token': False}
    self.files = {SP_FILE: model, 'tokenizer_config.json': json.dumps(config, indent=2).encode()}

  def _piece(self, i: int | None) -> str | None:
    return self.processor.id_to_piece(i) if i is not None else None

  def encode(self, text: str) -> np.ndarray:
    return np.asarray(self.processor.encode(text), np.int32)

  def _encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
    return self.processor.encode(list(texts))

  def _decode(self, ids: list[int]) -> str:
    return self.processor.decode(ids)


Tokenizer = ByteTokenizer | HFTokenizer | SentencePieceTokenizer
BYTES = ByteTokenizer()
WHAT = "'byte', a Hugging Face tokenizer.json, a SentencePiece .model, or a directory holding one"


def has_tokenizer(directory: str | os.PathLike) -> bool:
  """Whether a (Hugging Face model) directory holds a tokenizer that `load` reads."""
  root = epath.Path(directory)
  return (root / 'tokenizer.json').exists() or (root / SP_FILE).exists()


def resolve(spec: str, hf_checkpoint: str) -> str:
  """data.tokenizer as the run uses it: '' is the init.hf_checkpoint directory's tokenizer, else 'byte'.

  A checkpoint without a tokenizer is an error, not bytes: its model was trained on other ids.
  """
  if spec or not hf_checkpoint:
    return spec or 'byte'
  if not has_tokenizer(hf_checkpoint):
    raise ConfigError(f'init.hf_checkpoint={hf_checkpoint!r} holds neither tokenizer.json nor {SP_FILE}: '
                      'pass data.tokenizer=byte to train on bytes, or add the tokenizer files to the '
                      'directory.')
  return hf_checkpoint


def describe(tok: Tokenizer, spec: str, hf_checkpoint: str) -> str:
  """The console's line on the tokenizer a run uses (`spec`, resolved) and where it comes from."""
  kind = ('byte-level' if isinstance(tok, ByteTokenizer) else
          'Hugging Face tokenizer.json' if isinstance(tok, HFTokenizer) else 'SentencePiece model')
  where = (f'init.hf_checkpoint={hf_checkpoint}' if hf_checkpoint and spec == hf_checkpoint
           else f'data.tokenizer={spec}')
  return f'tokenizer: {kind}, {tok.vocab_size} ids, from {where}'


def load(spec: str) -> Tokenizer:
  """The tokenizer `data.tokenizer=spec` names (after `resolve`; '' unresolved, with no checkpoint to take
  one from, is 'byte'); a one-line ConfigError for a path that is missing or holds no tokenizer."""
  if spec in ('byte', ''):
    return BYTES
  where = f'data.tokenizer={spec!r}'
  path = epath.Path(os.path.expanduser(spec))
  if path.is_dir():
    if (path / 'tokenizer.json').exists():
      path = path / 'tokenizer.json'
    elif (path / SP_FILE).exists():
      path = path / SP_FILE
    else:
      raise ConfigError(f'{where}: the directory holds neither tokenizer.json nor {SP_FILE}; give {WHAT}.')
  elif not path.exists():
    raise ConfigError(f'{where} does not exist; give {WHAT}.')
  if path.suffix not in ('.json', '.model'):
    raise ConfigError(f'{where} is not a tokenizer; give {WHAT}.')
  try:
    if path.suffix == '.model':
      return SentencePieceTokenizer(spec, path.read_bytes())
    files = {name: (path.parent / name).read_bytes() for name in HF_FILES if (path.parent / name).exists()}
    files['tokenizer.json'] = path.read_bytes()
    return HFTokenizer(spec, files)
  except Exception as e:  # The libraries raise their own kinds (a Rust panic, RuntimeError, ...).
    kind = 'SentencePiece model' if path.suffix == '.model' else 'Hugging Face tokenizer.json'
    reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
    raise ConfigError(f'{where}: {path} is not a {kind} ({reason}).') from None


def for_run(run_dir: str | os.PathLike, spec: str) -> Tokenizer:
  """The tokenizer a run trained with: its copy in the workdir, else `load(spec)` (its config's)."""
  saved = epath.Path(run_dir) / RUN_DIR
  return load(os.fspath(saved)) if saved.exists() else load(spec)
