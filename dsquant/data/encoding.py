"""Tokenize documents the way the bundled models were trained: BOS + text + EOS per document.

`tokenizer` is a transformers tokenizer (anything callable like one, with `bos_token_id` and
`eos_token_id`; either id may be None, and is then left out).
"""


def encode_documents(tokenizer, docs: list[str]) -> list[list[int]]:
    """Token ids of each document, framed by the tokenizer's BOS and EOS ids where it has them."""
    # verbose=False: documents are longer than model_max_length on purpose; no warning wanted.
    ids = tokenizer(docs, add_special_tokens=False, verbose=False)["input_ids"]
    bos = [tokenizer.bos_token_id] if getattr(tokenizer, "bos_token_id", None) is not None else []
    eos = [tokenizer.eos_token_id] if getattr(tokenizer, "eos_token_id", None) is not None else []
    return [bos + list(doc_ids) + eos for doc_ids in ids]
