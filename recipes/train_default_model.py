"""Train the toolkit's built-in default model pair (target + draft) from the Python standard library.

The toolkit can never download weights, yet `toolkit generate "What is a list comprehension?"` must
print English-like text about Python. This recipe builds that pair offline, on CPU, in about 70
minutes on both cores of a 2-core machine:

1. Corpus, from nothing but what CPython ships: the language-reference topics of
   `pydoc_data.topics` and the docstrings of every public stdlib module and submodule this Python
   has (modules, classes, functions, methods; a few with import side effects or only test code are
   left out), plus synthetic question/answer pairs built from them, in three shapes
   ("Question: ...\nAnswer: ...", a bare question line followed by the answer, and the chat
   template), so that a question prompt is followed by an answer-like text. About 754k tokens.
2. A byte-level BPE tokenizer (`tokenizers`, vocab 8192), wrapped as `PreTrainedTokenizerFast` with
   <|bos|>/<|eos|>/<|pad|>, role tokens and a Jinja chat template; or, with `--tokenizer DIR`, an
   earlier run's (what keeps held-out losses comparable between runs).
3. A target `LlamaForCausalLM` (12.59M parameters: hidden 384, 6 layers, 6 heads, 2 KV heads,
   tied embeddings) and a 2-layer draft (3.67M, hidden 256; `--draft-*` change it) with the same
   tokenizer, trained in float32 with AdamW + warmup/cosine on random 256-token windows; the draft
   is distilled from the finished target (0.8 KL to the target's distribution + 0.2 cross-entropy),
   or from `--target-from DIR`, a target trained before.
4. Both saved with `save_pretrained(safe_serialization=True)` in bfloat16 into `<out>/target` and
   `<out>/draft`, each with its tokenizer files (about 34 MB together).

Everything is seeded and the corpus order is fixed, so a rerun on the same Python (the docstrings
differ between CPython versions), the same torch and thread count reproduces the same weights.

    python recipes/train_default_model.py --seed 0 --steps 1500 --draft-steps 750 \
        --tokenizer toolkit/default_model/target --baseline toolkit/default_model --out /tmp/pair

`--baseline DIR` first scores an existing pair on this run's held-out tokens (same tokenizer), so
the summary shows the held-out loss before and after. Progress, the final train and held-out
losses, the draft's greedy agreement with the target and a JSON summary are printed.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import math
import os
import random
import re
import shutil
import sys
import time
import warnings
from pathlib import Path

# One thread for the tokenizer trainer too (rayon reads this when tokenizers starts).
os.environ.setdefault("RAYON_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

# --------------------------------------------------------------------------------------------------
# Corpus
# --------------------------------------------------------------------------------------------------

# Modules left out: import side effects (antigravity, this, GUI toolkits), the test suites, and
# packaging internals whose docstrings are not about Python. Anything that fails to import is skipped.
SKIPPED_MODULES = {
    "__main__", "__phello__", "antigravity", "ensurepip", "idlelib", "lib2to3", "pydoc_data", "test", "this",
    "tkinter", "turtle", "turtledemo", "xxlimited", "xxlimited_35", "xxsubtype",
}


def stdlib_modules() -> list[str]:
    """Every public module and submodule of the standard library this Python ships, sorted."""
    import pkgutil

    names = {n for n in sys.builtin_module_names if not n.startswith("_")}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for info in pkgutil.iter_modules():
            if info.name not in sys.stdlib_module_names or info.name.startswith("_") or info.name in SKIPPED_MODULES:
                continue
            names.add(info.name)
            if not info.ispkg:
                continue
            try:
                package = importlib.import_module(info.name)
            except Exception:
                continue
            for sub in pkgutil.walk_packages(package.__path__, info.name + ".", onerror=lambda _name: None):
                if not any(part.startswith("_") or part in ("test", "tests") for part in sub.name.split(".")):
                    names.add(sub.name)
    return sorted(names)


_UNDERLINE = re.compile(r"^([*=\-~^])\1{2,}\s*$")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"'(])")


def unwrap(text: str) -> str:
    """Join hard-wrapped prose paragraphs into single lines; keep code, grammar and lists as is."""
    out = []
    for block in re.split(r"\n[ \t]*\n", text.strip("\n")):
        lines = block.split("\n")
        prose = all(
            line and not line[0].isspace() and not re.match(r"^([-*+]|\d+\.|>>>|\.\.\.)\s", line)
            and not _UNDERLINE.match(line)
            for line in lines
        )
        out.append(" ".join(l.strip() for l in lines) if prose and len(lines) > 1 else block.rstrip())
    return "\n\n".join(out).strip()


def first_sentences(paragraph: str, n: int = 3, max_chars: int = 480) -> str:
    sentences = _SENTENCE_END.split(paragraph.strip())
    answer = ""
    for s in sentences[:n]:
        if answer and len(answer) + len(s) + 1 > max_chars:
            break
        answer = f"{answer} {s}".strip()
    return answer


def prose_paragraphs(text: str) -> list[str]:
    """The prose paragraphs of an unwrapped text (no headings, code, grammar or lists)."""
    paras = []
    for block in text.split("\n\n"):
        b = block.strip()
        if not b or "\n" in b or b[0].isspace() or "::=" in b or b.startswith((">>>", "*", "-")):
            continue
        if len(b) < 40 or not re.search(r"[a-z]", b) or not b.rstrip().endswith((".", ":", ")")):
            continue
        paras.append(b)
    return paras


def topic_sections(raw: str) -> list[tuple[str, str]]:
    """Split a pydoc topic into (title, unwrapped body) sections by its underlined headings."""
    lines = raw.split("\n")
    sections, title, body = [], None, []
    i = 0
    while i < len(lines):
        if i + 1 < len(lines) and lines[i].strip() and _UNDERLINE.match(lines[i + 1]):
            if title is not None:
                sections.append((title, unwrap("\n".join(body))))
            title, body = lines[i].strip(), []
            i += 2
            continue
        body.append(lines[i])
        i += 1
    if title is not None:
        sections.append((title, unwrap("\n".join(body))))
    return sections


def topic_question_subject(title: str) -> str | None:
    t = title.strip().rstrip(".:")
    if not t or len(t) > 60 or t.lower().startswith(("note", "footnote", "see also", "example")):
        return None
    # "Format String Syntax" -> "format string syntax"; keeps "I/O", "Python", quoted names.
    words = [w.lower() if re.fullmatch(r"[A-Z][a-z]+", w) and w != "Python" else w for w in t.split(" ")]
    return " ".join(words)


def qa_templates(subject: str, plural: bool) -> list[str]:
    be = "are" if plural else "is"
    return [f"What {be} {subject}?", f"Explain {subject}.", f"How do {subject} work?" if plural
            else f"How does {subject} work?"]


def module_docstrings(names: list[str]) -> tuple[list[str], list[tuple[str, str]]]:
    """Docstring documents of the modules, classes and routines, and (question, answer) pairs."""
    docs, qa, seen = [], [], set()

    def add(qualname: str, obj) -> str | None:
        try:
            doc = inspect.getdoc(obj)
        except Exception:
            return None
        if not doc or len(doc) < 40 or doc in seen:
            return None
        seen.add(doc)
        text = unwrap(doc)
        docs.append(f"{qualname}\n\n{text}")
        return text

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for modname in names:
            try:
                mod = importlib.import_module(modname)
            except Exception:
                continue
            text = add(modname, mod)
            if text and modname != "builtins":
                paras = prose_paragraphs(text)
                if paras:
                    qa.append((f"What is the {modname} module?", first_sentences(paras[0])))
            for name, obj in sorted(vars(mod).items()):
                if name.startswith("_"):
                    continue
                owner = getattr(obj, "__module__", None)
                if owner != modname and not (modname == "builtins" and owner == "builtins"):
                    continue
                if inspect.isclass(obj):
                    ctext = add(f"{modname}.{name}", obj)
                    if ctext and modname == "builtins" and prose_paragraphs(ctext):
                        qa.append((f"What is {name} in Python?", first_sentences(prose_paragraphs(ctext)[0])))
                    for mname, member in sorted(vars(obj).items()):
                        if mname.startswith("_"):
                            continue
                        if inspect.isroutine(member) or isinstance(member, (property, classmethod, staticmethod)):
                            mtext = add(f"{modname}.{name}.{mname}", member)
                            if mtext and modname == "builtins" and prose_paragraphs(mtext):
                                qa.append((f"What does {name}.{mname}() do?",
                                           first_sentences(prose_paragraphs(mtext)[0])))
                elif inspect.isroutine(obj):
                    ftext = add(f"{modname}.{name}", obj)
                    if ftext and prose_paragraphs(ftext):
                        qname = name if modname == "builtins" else f"{modname}.{name}"
                        qa.append((f"What does {qname}() do?", first_sentences(prose_paragraphs(ftext)[0])))
    return docs, qa


def build_corpus() -> tuple[list[str], list[str], dict]:
    """Return (documents, chat/QA documents, stats) in a fixed order."""
    import pydoc_data.topics

    docs: list[str] = []
    qa: list[tuple[str, str]] = []
    for key in sorted(pydoc_data.topics.topics):
        raw = pydoc_data.topics.topics[key]
        sections = topic_sections(raw)
        if not sections:
            docs.append(unwrap(raw))
            continue
        docs.append("\n\n".join(f"{t}\n\n{b}".strip() for t, b in sections))
        for title, body in sections:
            subject = topic_question_subject(title)
            paras = prose_paragraphs(body)
            if not subject or not paras:
                continue
            plural = subject.split()[-1].endswith("s") and not subject.split()[-1].endswith(("ss", "us", '"'))
            for i, q in enumerate(qa_templates(subject, plural)):
                start = min(i, len(paras) - 1)  # vary the answer a little between templates
                qa.append((q, first_sentences(paras[0] if i == 0 else paras[start])))
    topic_qa = len(qa)
    mdocs, mqa = module_docstrings(stdlib_modules())
    docs.extend(mdocs)
    qa.extend(mqa)

    qa_docs: list[str] = []
    for j, (q, a) in enumerate(qa):
        if not a:
            continue
        # Three shapes: the plain "Question/Answer" form, a bare question line, the chat form.
        qa_docs.append(f"Question: {q}\nAnswer: {a}")
        qa_docs.append(f"{q}\n{a}")
        qa_docs.append(("chat", q, a))  # rendered with the chat template once the tokenizer exists
    stats = {"documents": len(docs), "qa_pairs": len(qa), "topic_qa_pairs": topic_qa,
             "doc_chars": sum(len(d) for d in docs)}
    return docs, qa_docs, stats


# --------------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------------

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
ROLE_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>"]
SPECIAL_TOKENS = [BOS, EOS, PAD, *ROLE_TOKENS]

# Only the assistant's turns end with <|eos|>: a question is followed by a newline and the answer,
# as in the plain-text question/answer shapes, so a bare question prompt does not stop at once.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ '<|eos|>' }}{% endif %}{{ '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        extra_special_tokens=ROLE_TOKENS,
        chat_template=CHAT_TEMPLATE,
        model_max_length=1024,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )


# --------------------------------------------------------------------------------------------------
# Models and training
# --------------------------------------------------------------------------------------------------


def llama_config(vocab_size: int, tokenizer, hidden: int, layers: int, heads: int, kv_heads: int,
                 intermediate: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=1024,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        initializer_range=0.02,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def batches(stream: torch.Tensor, batch: int, seq: int, gen: torch.Generator):
    """Random windows of seq+1 tokens from the packed token stream."""
    n = stream.numel() - seq - 1
    while True:
        starts = torch.randint(0, n, (batch,), generator=gen)
        yield torch.stack([stream[s : s + seq + 1] for s in starts.tolist()])


def make_optimizer(model, lr: float, weight_decay: float):
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr, betas=(0.9, 0.95), eps=1e-8,
    )


def lr_at(step: int, total: int, peak: float, warmup: int, floor: float = 0.1) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


@torch.no_grad()
def evaluate(model, stream: torch.Tensor, seq: int, batch: int = 8, n_batches: int = 16, seed: int = 0) -> float:
    model.eval()
    gen = torch.Generator().manual_seed(seed)
    it = batches(stream, batch, seq, gen)
    total = 0.0
    for _ in range(n_batches):
        x = next(it)
        logits = model(input_ids=x[:, :-1]).logits
        total += F.cross_entropy(logits.reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1)).item()
    model.train()
    return total / n_batches


def train(model, stream, val_stream, *, steps: int, batch: int, seq: int, lr: float, warmup: int,
          seed: int, name: str, teacher=None, distill_weight: float = 0.0, log_every: int = 20):
    gen = torch.Generator().manual_seed(seed)
    it = batches(stream, batch, seq, gen)
    opt = make_optimizer(model, lr, weight_decay=0.1)
    model.train()
    t0 = time.time()
    ema = None
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, lr, warmup)
        x = next(it)
        inputs, labels = x[:, :-1], x[:, 1:]
        logits = model(input_ids=inputs).logits
        flat = logits.reshape(-1, logits.size(-1))
        ce = F.cross_entropy(flat, labels.reshape(-1))
        loss = ce
        if teacher is not None and distill_weight > 0:
            with torch.no_grad():
                t_logp = F.log_softmax(teacher(input_ids=inputs).logits.reshape(-1, flat.size(-1)), -1)
            kl = F.kl_div(F.log_softmax(flat, -1), t_logp, log_target=True, reduction="batchmean")
            loss = (1 - distill_weight) * ce + distill_weight * kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        ema = ce.item() if ema is None else 0.9 * ema + 0.1 * ce.item()
        if step % log_every == 0 or step == steps - 1:
            el = time.time() - t0
            tps = (step + 1) * batch * seq / el
            print(f"[{name}] step {step + 1}/{steps} ce {ce.item():.3f} (ema {ema:.3f}) loss {loss.item():.3f} "
                  f"lr {opt.param_groups[0]['lr']:.2e} {tps:.0f} tok/s elapsed {el / 60:.1f} min", flush=True)
    val = evaluate(model, val_stream, seq, seed=seed + 1)
    print(f"[{name}] done in {(time.time() - t0) / 60:.1f} min: final train ce (ema) {ema:.3f}, "
          f"held-out ce {val:.3f} (ppl {math.exp(val):.1f})", flush=True)
    return {"train_ce_ema": round(ema, 4), "val_ce": round(val, 4), "minutes": round((time.time() - t0) / 60, 2)}


def save(model, tokenizer, out: Path, max_new_tokens: int = 128) -> None:
    from transformers import GenerationConfig

    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    model = model.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, max_new_tokens=max_new_tokens,
    )
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    # Older loaders (and transformers 4.x) read `torch_dtype` and a top-level `rope_theta`.
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.setdefault("torch_dtype", "bfloat16")
    cfg.setdefault("rope_theta", cfg.get("rope_parameters", {}).get("rope_theta", 10000.0))
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    # The generic class name, which every transformers version resolves.
    tc_path = out / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text())
    tc["tokenizer_class"] = "PreTrainedTokenizerFast"
    for key in ("is_local", "local_files_only"):  # where a reused tokenizer was loaded from: not a setting
        tc.pop(key, None)
    tc_path.write_text(json.dumps(tc, indent=2, sort_keys=True) + "\n")


@torch.no_grad()
def greedy_agreement(target, draft, stream: torch.Tensor, seq: int, seed: int, n_batches: int = 16) -> float:
    """How often the draft's next-token argmax equals the target's on held-out text: a proxy for the
    greedy acceptance rate of speculative decoding."""
    target.eval()
    draft.eval()
    it = batches(stream, 8, seq, torch.Generator().manual_seed(seed))
    same = total = 0
    for _ in range(n_batches):
        x = next(it)[:, :-1]
        same += int((target(input_ids=x).logits.argmax(-1) == draft(input_ids=x).logits.argmax(-1)).sum())
        total += x.numel()
    return same / total


def evaluate_baseline(folder: Path, val_stream: torch.Tensor, seq: int, seed: int) -> dict:
    """Held-out cross-entropy of an existing pair on this run's held-out tokens (same tokenizer)."""
    from transformers import LlamaForCausalLM

    result = {}
    for name in ("target", "draft"):
        model = LlamaForCausalLM.from_pretrained(folder / name, dtype=torch.float32)
        result[name] = round(evaluate(model, val_stream, seq, seed=seed + 1), 4)
    target = LlamaForCausalLM.from_pretrained(folder / "target", dtype=torch.float32)
    draft = LlamaForCausalLM.from_pretrained(folder / "draft", dtype=torch.float32)
    result["greedy_agreement"] = round(greedy_agreement(target, draft, val_stream, seq, seed + 1), 4)
    print(f"baseline {folder}: held-out ce target {result['target']:.3f}, draft {result['draft']:.3f}, "
          f"greedy agreement {result['greedy_agreement']:.1%}", flush=True)
    return result


def param_count(model) -> int:
    return sum(p.numel() for p in model.parameters())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=560, help="target optimizer steps")
    ap.add_argument("--draft-steps", type=int, default=None, help="draft optimizer steps (default steps/4)")
    ap.add_argument("--out", type=Path, default=Path("toolkit/default_model"))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1.5e-3)
    ap.add_argument("--draft-lr", type=float, default=2e-3)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--distill", type=float, default=0.8, help="weight of the KL-to-target term for the draft")
    ap.add_argument("--tokenizer", type=Path, default=None,
                    help="reuse this folder's tokenizer instead of training one (keeps losses comparable)")
    ap.add_argument("--target-from", type=Path, default=None,
                    help="a trained target folder: skip the target's training and distill a new draft from it")
    ap.add_argument("--draft-hidden", type=int, default=256)
    ap.add_argument("--draft-layers", type=int, default=2)
    ap.add_argument("--draft-heads", type=int, default=4, help="attention heads of the draft (head_dim = hidden/heads)")
    ap.add_argument("--draft-intermediate", type=int, default=768)
    ap.add_argument("--baseline", type=Path, default=None,
                    help="a pair (<dir>/target, <dir>/draft) to evaluate on the same held-out tokens first")
    args = ap.parse_args(argv)
    draft_steps = args.draft_steps if args.draft_steps is not None else max(1, args.steps // 4)

    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    t_start = time.time()

    from transformers import LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()

    docs, qa_docs, stats = build_corpus()
    print(f"corpus: {stats['documents']} documents ({stats['doc_chars'] / 1e6:.2f}M chars), "
          f"{stats['qa_pairs']} question/answer pairs ({stats['topic_qa_pairs']} from topics), "
          f"{len(qa_docs)} QA documents", flush=True)

    plain_qa = [d for d in qa_docs if isinstance(d, str)]
    if args.tokenizer is not None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    else:
        tokenizer = train_tokenizer(docs + plain_qa, args.vocab)
    vocab_size = len(tokenizer)
    print(f"tokenizer: vocab {vocab_size}, specials {tokenizer.all_special_tokens}", flush=True)

    # Pack <|bos|> doc <|eos|> (chat pairs through the chat template) into one stream per split.
    # Every 50th unit (a document, or a question/answer pair in all its three shapes) is held out.
    eos = tokenizer.eos_token_id
    units = [[d] for d in docs] + [qa_docs[i : i + 3] for i in range(0, len(qa_docs), 3)]
    train_ids: list[int] = []
    val_ids: list[int] = []
    for u, unit in enumerate(units):
        ids = val_ids if u % 50 == 49 else train_ids
        for d in unit:
            if isinstance(d, tuple):
                _, q, a = d
                msgs = [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
                ids.extend(tokenizer.apply_chat_template(msgs, tokenize=True, return_dict=False))
            else:
                ids.extend(tokenizer(d)["input_ids"])  # <|bos|> ... (post-processor)
                ids.append(eos)
    train_stream = torch.tensor(train_ids, dtype=torch.long)
    val_stream = torch.tensor(val_ids, dtype=torch.long)
    n_tokens = train_stream.numel() + val_stream.numel()
    print(f"tokens: {n_tokens} ({train_stream.numel()} train, {val_stream.numel()} held out)", flush=True)

    baseline = evaluate_baseline(args.baseline, val_stream, args.seq, args.seed) if args.baseline else None
    torch.manual_seed(args.seed)
    target = LlamaForCausalLM(llama_config(vocab_size, tokenizer, hidden=384, layers=6, heads=6, kv_heads=2,
                                           intermediate=1024)).float()
    if args.target_from is not None:
        target = LlamaForCausalLM.from_pretrained(args.target_from, dtype=torch.float32)
    torch.manual_seed(args.seed + 1)
    draft = LlamaForCausalLM(llama_config(vocab_size, tokenizer, hidden=args.draft_hidden, layers=args.draft_layers,
                                          heads=args.draft_heads, kv_heads=min(2, args.draft_heads),
                                          intermediate=args.draft_intermediate)).float()
    n_target, n_draft = param_count(target), param_count(draft)
    print(f"params: target {n_target / 1e6:.2f}M, draft {n_draft / 1e6:.2f}M", flush=True)

    tokens_per_step = args.batch * args.seq
    if args.target_from is None:
        t_res = train(target, train_stream, val_stream, steps=args.steps, batch=args.batch, seq=args.seq,
                      lr=args.lr, warmup=max(1, min(40, args.steps // 10)), seed=args.seed, name="target")
    else:
        t_res = {"from": str(args.target_from), "val_ce": round(evaluate(target, val_stream, args.seq, seed=args.seed + 1), 4)}
    target.eval()
    d_res = train(draft, train_stream, val_stream, steps=draft_steps, batch=args.batch, seq=args.seq,
                  lr=args.draft_lr, warmup=max(1, min(40, draft_steps // 10)), seed=args.seed + 7, name="draft",
                  teacher=target, distill_weight=args.distill)

    agreement = greedy_agreement(target, draft, val_stream, args.seq, args.seed + 1)
    print(f"draft's argmax equals the target's on {agreement:.1%} of held-out tokens", flush=True)
    save(target, tokenizer, args.out / "target")
    save(draft, tokenizer, args.out / "draft")
    sizes = {p.name: sum(f.stat().st_size for f in p.iterdir()) for p in (args.out / "target", args.out / "draft")}
    wall = (time.time() - t_start) / 60
    summary = {
        "seed": args.seed, "steps": args.steps, "draft_steps": draft_steps, "batch": args.batch, "seq": args.seq,
        "tokens_per_step": tokens_per_step, "corpus_tokens": int(n_tokens), "vocab_size": vocab_size,
        "target_params": n_target, "draft_params": n_draft, "target": t_res, "draft": d_res,
        "greedy_agreement": round(agreement, 4), "baseline": baseline, "threads": args.threads,
        "bytes": sizes, "wall_minutes": round(wall, 1), "python": sys.version.split()[0],
        "torch": torch.__version__,
    }
    print("summary " + json.dumps(summary), flush=True)
    print(f"final loss: target {t_res.get('train_ce_ema', float('nan')):.3f} (held-out {t_res['val_ce']:.3f}), "
          f"draft {d_res['train_ce_ema']:.3f} (held-out {d_res['val_ce']:.3f}); wall {wall:.1f} min", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
