"""OpenAI legacy-completions `echo` and `logprobs` for /v1/completions.

A request with `logprobs: N` gets, per returned token, its string, its log-probability and the
N most likely strings at that position (`tokens`, `token_logprobs`, `top_logprobs`,
`text_offset`); with `echo: true` the prompt's tokens come first (the first prompt token has
no log-probability: null) and the text starts with the prompt. `echo: true, max_tokens: 0`
scores the prompt alone, as loglikelihood evaluations (lm-evaluation-harness's
`local-completions`) ask.

Chat's `logprobs: true, top_logprobs: N` come back in OpenAI's chat shape (`chat_logprobs`):
per generated token {token, logprob, bytes, top_logprobs: [N x {token, logprob, bytes}]}.
"""
from __future__ import annotations

from dsquant.runtime.server import protocol as P


def token_string(tokenizer, token_id: int) -> str:
    if tokenizer is None:
        return f"token_id:{token_id}"
    return tokenizer.decode([token_id], skip_special_tokens=False)


def completion_choice(req: P.CompletionRequest, ids: list[int], final, tokenizer, prompt=None,
                      index: int = 0) -> tuple[P.CompletionChoice, int]:
    """The response choice of a finished non-streaming request, and its count of completion tokens.

    ids: the prompt's token ids; prompt: the prompt as sent (text or ids; default req.prompt);
    final: the request's last RequestOutput. With max_tokens 0 the one token the engine generated
    (it always generates at least one) is left out.
    """
    prompt = req.prompt if prompt is None else prompt
    keep = 0 if req.max_tokens == 0 else len(final.token_ids)
    text = final.text if keep else ""
    finish = final.finish_reason if keep else "length"
    if req.echo:
        prompt_text = prompt if isinstance(prompt, str) else (
            tokenizer.decode(ids, skip_special_tokens=False) if tokenizer is not None else "")
        text = prompt_text + text
    logprobs = None
    if req.logprobs is not None:
        entries: list[tuple[int, tuple[float, dict] | None]] = []
        if req.echo:
            entries += list(zip(ids, final.prompt_logprobs or [None] * len(ids)))
        entries += list(zip(final.token_ids[:keep], (final.logprobs or [])[:keep]))
        logprobs = _openai_logprobs(entries, tokenizer)
    return P.CompletionChoice(index=index, text=text, logprobs=logprobs, finish_reason=finish), keep


def chat_logprobs(token_ids: list[int], entries: list, top_n: int, tokenizer) -> P.ChatLogprobs:
    """Chat logprobs of the generated tokens token_ids, whose engine entries are (logprob, {id: logprob})."""
    def one(token_id: int, value: float) -> dict:
        s = token_string(tokenizer, token_id)
        return {"token": s, "logprob": value, "bytes": list(s.encode("utf-8", "surrogatepass"))}

    content = []
    for token_id, (value, top) in zip(token_ids, entries):
        ranked = sorted(top.items(), key=lambda kv: -kv[1])[:top_n]
        content.append(P.ChatTokenLogprob(**one(token_id, value),
                                          top_logprobs=[P.ChatTopLogprob(**one(t, lp)) for t, lp in ranked]))
    return P.ChatLogprobs(content=content)


def _openai_logprobs(entries, tokenizer) -> P.CompletionLogprobs:
    tokens, token_logprobs, top_logprobs, offsets, offset = [], [], [], [], 0
    for token_id, entry in entries:
        s = token_string(tokenizer, token_id)
        tokens.append(s)
        offsets.append(offset)
        offset += len(s)
        if entry is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        value, top = entry
        token_logprobs.append(value)
        strings: dict[str, float] = {}
        for t, lp in top.items():  # two ids may decode alike: keep the likelier
            k = token_string(tokenizer, t)
            strings[k] = max(lp, strings.get(k, float("-inf")))
        top_logprobs.append(strings)
    return P.CompletionLogprobs(tokens=tokens, token_logprobs=token_logprobs, top_logprobs=top_logprobs,
                                text_offset=offsets)
