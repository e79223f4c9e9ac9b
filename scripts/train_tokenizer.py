"""Train dsquant's bundled byte-level BPE tokenizer (vocabulary 8192) on the training corpus.

    python scripts/train_tokenizer.py --corpus /work/shared/corpora/train.jsonl.xz \
        --out dsquant/assets/tokenizer

Reproducible: the `tokenizers` BPE trainer is deterministic for a fixed input order, and the
documents are fed in file order. The output is a transformers tokenizer directory
(tokenizer.json + tokenizer_config.json with the chat template inline, not in a .jinja file),
loadable offline with `transformers.AutoTokenizer.from_pretrained(dir)` (or, inside a model dir,
`dsquant.data.load_tokenizer(dir)`: see dsquant/data/tokenizer.py). Special tokens follow
DeepSeek's names; the chat template follows DeepSeek-V3's turn markers.
"""
import argparse
import json
import lzma
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

VOCAB_SIZE = 8192
BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
SPECIAL_TOKENS = [BOS, EOS, USER, ASSISTANT]  # ids 0..3, in this order

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] }}\n"
    "{% elif message['role'] == 'user' %}" + USER + "{{ message['content'] }}"
    "{% elif message['role'] == 'assistant' %}" + ASSISTANT + "{{ message['content'] }}{{ eos_token }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}" + ASSISTANT + "{% endif %}"
)


def read_texts(corpus: Path):
    with lzma.open(corpus, "rt", encoding="utf-8") as f:
        for line in f:
            yield json.loads(line)["text"]


def train(corpus: Path) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    # GPT-2 style split (letters, digits, punctuation, whitespace runs) over the byte alphabet.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(read_texts(corpus), trainer=trainer)
    # Encoding with add_special_tokens=True prepends BOS, as DeepSeek's tokenizers do.
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, 0)]
    )
    return tokenizer


def save(tokenizer: Tokenizer, out: Path) -> PreTrainedTokenizerFast:
    assert tokenizer.token_to_id(BOS) == 0 and tokenizer.token_to_id(EOS) == 1
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=EOS,
        additional_special_tokens=[USER, ASSISTANT],
        chat_template=CHAT_TEMPLATE,
        model_max_length=2048,
        clean_up_tokenization_spaces=False,
    )
    out.mkdir(parents=True, exist_ok=True)
    wrapped.save_pretrained(out, save_jinja_files=False)  # chat template inline in tokenizer_config.json
    # transformers 5 writes its own backend class name; the generic fast class also loads in 4.x.
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    return wrapped


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", type=Path, default=Path("/work/shared/corpora/train.jsonl.xz"))
    parser.add_argument("--out", type=Path, default=Path("dsquant/assets/tokenizer"))
    args = parser.parse_args()
    tokenizer = train(args.corpus)
    save(tokenizer, args.out)
    config = json.loads((args.out / "tokenizer_config.json").read_text())
    assert "chat_template" in config, "chat template missing from tokenizer_config.json"
    print(f"saved {tokenizer.get_vocab_size()}-token tokenizer to {args.out}")


if __name__ == "__main__":
    main()
