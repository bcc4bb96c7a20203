"""What `moesys train` checks before it launches anything: the errors each worker would otherwise meet at start,
after torchrun had retried it (a tokenizer that does not load or fit the model, data that cannot be read or is shorter
than a window, a resume point that does not exist, an expert store that cannot be written or that another run owns).
Each raises a UserError of one line. The checks of the plan itself (it fits, the disk has room) are
runtime/plan/checks.py."""

from __future__ import annotations

import tempfile
from pathlib import Path

from runtime.config import MoesysConfig
from runtime.data.chat_records import is_chat, read_chat
from runtime.data.pretokenize import data_sources, encode_source
from runtime.data.text import check_token_count, is_token_file, source_name
from runtime.data.token_file import check_ids, open_token_file
from runtime.data.tokenizer import (
    BYTES,
    Tokenizer,
    byte_tokenizer,
    checkpoint_tokenizer_file,
    load_tokenizer,
    tokenizer_digest,
)
from runtime.errors import UserError
from runtime.files.paths import expert_store_root, run_dir_of
from runtime.files.resume import chosen_checkpoint
from runtime.plan.modes import OffloadMode, requested_modes


def check_before_launch(cfg: MoesysConfig) -> None:
    """What would fail in every worker: a serving config, a tokenizer or data that cannot be used, an expert store
    that is not writable or belongs to another run. cfg.train.run_dir must be set (the directory the job will use)."""
    if cfg.purpose != "train":
        raise UserError(f"this config is for serving (purpose={cfg.purpose}: {cfg.recipe or 'the recipe'} is planned "
                        "as an inference budget); serve it with moesys infer, or set purpose=train to train it")
    tokenizer = check_tokenizer(cfg)
    for key, path in data_sources(cfg).items():
        if path is not None and is_chat(path, cfg.train.data_format):
            for _ in read_chat(path, key):  # DataError naming the first malformed line
                pass
            continue
        check_source(path, key, cfg, tokenizer)  # DataError: missing, empty, too short, unreadable
    if OffloadMode.SSD in requested_modes(cfg.storage.offload):
        _check_store(expert_store_root(cfg), str(run_dir_of(cfg).resolve()))


def check_tokenizer(cfg: MoesysConfig) -> Tokenizer:
    """train.tokenizer loads, model.vocab_size has a row for each of its ids, and a resume continues with the
    tokenizer its checkpoint was trained with. Also refuses a train.resume_from=step_N the run has no checkpoint of."""
    tr, vocab = cfg.train, cfg.model.vocab_size
    tokenizer = load_tokenizer(tr.tokenizer, vocab_size=vocab)
    if tokenizer.vocab_size > vocab:
        raise UserError(f"train.tokenizer={tr.tokenizer} has {tokenizer.vocab_size} tokens, more than model.vocab_size="
                        f"{vocab}; set model.vocab_size={tokenizer.vocab_size} (or more)")
    start = chosen_checkpoint(cfg)
    if start is not None:
        saved = checkpoint_tokenizer_file(run_dir_of(cfg), start)
        trained = load_tokenizer(saved, "tokenizer") if saved else byte_tokenizer(vocab)
        if tokenizer_digest(trained) != tokenizer_digest(tokenizer):
            was = saved or BYTES
            raise UserError(f"cannot resume {tr.run_dir} from {start.name}: it was trained with another tokenizer "
                            f"({was}); set train.tokenizer={was}, train.resume_from=none to start over, or choose a "
                            "new train.run_dir")
    return tokenizer


def check_source(path: str | None, key: str, cfg: MoesysConfig, tokenizer: Tokenizer) -> None:
    """One data source is readable and holds more than one window: a token file's size, dtype and first ids; a text
    source's first tokens (`moesys train` then tokenizes the rest before launch, which finds any later problem)."""
    name, seq_len = source_name(path, key), cfg.train.seq_len
    if path is not None and is_token_file(path):
        tokens = open_token_file(path, tokenizer.vocab_size, key)
        check_token_count(tokens.size, seq_len, name)
        check_ids(tokens, cfg.model.vocab_size, name)
        return
    count = 0
    for ids in encode_source(path, tokenizer, key, cfg.train.data_text_key, errors=cfg.train.data_errors):
        count += ids.size
        if count > seq_len:
            return
    check_token_count(count, seq_len, name)


def _check_store(root: Path, run_dir: str) -> None:
    from runtime.storage.expert_store import OWNER, check_owner  # torch: only offloaded runs pay for it

    for marker in root.glob(f"*/{OWNER}"):  # one store per expert-parallel rank
        check_owner(marker.parent, run_dir)
    probe = root
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:  # where the store would be made: writable? (nothing is left behind, also for --dry-run)
        with tempfile.TemporaryFile(dir=probe):
            pass
    except OSError as exc:
        raise UserError(f"storage.ssd_path {root} cannot be created or written ({probe}: {exc.strerror or exc}); "
                        "set storage.ssd_path to a directory you can write") from None
