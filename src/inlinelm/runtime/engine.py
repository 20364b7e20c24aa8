"""The public async ``Engine``: starts the engine thread, admits requests, hands out streams."""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from inlinelm.chat_template import chat_kwargs
from inlinelm.errors import RequestError
from inlinelm.reasoning import ReasoningParser, reasoning_choice
from inlinelm.runtime.engine_pooling import EnginePooling
from inlinelm.runtime.outputs import RequestOutput
from inlinelm.runtime.prompt_source import (
    Prompt,
    PromptSource,
    chat_size,
    conversation_batch,
    prompt_batch,
    render_chat,
)
from inlinelm.runtime.stream import RequestStream
from inlinelm.runtime.sync import generate_all, run_sync
from inlinelm.sampling_params import SamplingParams

logger = logging.getLogger("inlinelm")


class Engine(EnginePooling):
    """An LLM engine living in this process: one engine thread, outputs on the callers' loops.

    ``Engine(model="default", **options)`` or ``Engine(EngineConfig(...))``. Construction does
    no heavy work; ``await engine.start()`` (or the first request) loads the model off the
    event loop. Use ``async with Engine(...) as engine`` or call ``aclose()``/``close()``.
    """

    async def __aenter__(self) -> Engine:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- requests ------------------------------------------------------------------------

    def stream(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        arrival_time: float | None = None,
        add_special_tokens: bool = True,
        input_size: int = 0,
        **overrides: Any,
    ) -> RequestStream:
        """Start generating for ``prompt`` (text or token ids) and return its stream.

        ``params`` (default: ``SamplingParams()``) with keyword ``overrides`` applied
        (``engine.stream(prompt, max_tokens=64, temperature=0)``). Sampling fields the
        caller leaves unset take the engine's defaults at submit: the model's
        generation_config.json and the ``default_*`` options (see
        :meth:`default_sampling_params`); an unset ``max_tokens`` is ``default_max_tokens``
        when set, else the model's, else 16 (vLLM's and OpenAI's completions default; a chat's
        is 1024), never the whole context.

        When the engine is started, validation, admission and the hand-over to the engine
        happen here, so ``RequestError``/``QueueFullError``/``EngineError`` raise at once;
        before that they raise from the first ``async for``/``await``.

        A prompt longer than ``max_inline_prompt_chars`` (characters, or token ids) is
        tokenized and checked on a worker thread, off the event loop. ``input_size`` says
        the prompt belongs to a larger input (a server passes its request body's size, for
        a request of many prompts): the rule then judges that size.
        """
        size = len(prompt) if isinstance(prompt, (str, list)) else 0
        source = PromptSource.of_prompt(prompt, add_special_tokens, max(size, input_size))
        return self._submitter.open(source, _params(params, overrides), request_id, arrival_time)

    def chat(
        self,
        messages: Sequence[dict[str, Any]],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        arrival_time: float | None = None,
        tools: Sequence[dict[str, Any]] | None = None,
        input_size: int = 0,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        reasoning_parser: str | ReasoningParser | None = None,
        **overrides: Any,
    ) -> RequestStream:
        """Like :meth:`stream`, with the model's chat template applied to ``messages``
        (and to ``tools``, OpenAI-style function tools, when given). The messages' and the
        tools' text together decide whether the template runs off the event loop.

        ``chat_template_kwargs``: template variables (``{"enable_thinking": False}``,
        ``{"reasoning_effort": "low"}``) over the ``default_chat_template_kwargs`` option.
        A reasoning model's thinking comes apart from its answer
        (``CompletionOutput.reasoning``) through :attr:`reasoning_parser`, or through
        ``reasoning_parser`` when given (a registered name, a parser, or ``"none"`` for
        answers left whole)."""
        size = chat_size(messages, tools, limit=self.config.max_inline_prompt_chars)
        kwargs = chat_kwargs(self.config.default_chat_template_kwargs, chat_template_kwargs)
        source = PromptSource.of_chat(
            messages, tools, max(size, input_size), template_kwargs=kwargs
        )
        return self._submitter.open(
            source,
            _params(params, overrides),
            request_id,
            arrival_time,
            reasoning=reasoning_choice(reasoning_parser),
        )

    def render_chat(
        self,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt text the chat template makes of ``messages`` (with the assistant turn
        opened), of ``tools`` when given (``apply_chat_template(..., tools=...)``) and
        with ``chat_template_kwargs`` over the default template variables."""
        kwargs = chat_kwargs(self.config.default_chat_template_kwargs, chat_template_kwargs)
        return render_chat(self.tokenizer, messages, tools, kwargs)

    def default_sampling_params(self, *, chat: bool = False) -> SamplingParams:
        """The values this engine gives a completion's (``chat=True``: a chat's) unset
        sampling fields (max_tokens, temperature, top_p, top_k, min_p,
        repetition_penalty): the ``default_*`` options when set, else the model's
        generation_config.json, else ``FALLBACK_SAMPLING`` (whose max_tokens is a chat's;
        a completion's is ``FALLBACK_COMPLETION_MAX_TOKENS``, 16). An unset ``max_tokens``
        is also cut to the room the prompt leaves in the context. Available once started."""
        return SamplingParams(**self._submitter.require_loaded().admission.defaults(chat=chat))

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | None = None,
        *,
        use_tqdm: bool = True,
        **overrides: Any,
    ) -> list[RequestOutput]:
        """Generate for one prompt or a list of them and wait: the sync :meth:`stream`.

        ``prompts`` is a string, token ids, or a list of either; ``params`` and keyword
        ``overrides`` work as in :meth:`stream` (unset fields take the engine's defaults,
        see :meth:`default_sampling_params`). Returns one final ``RequestOutput`` per
        prompt, in order. ``use_tqdm`` shows a progress bar on a terminal or in Jupyter.

        Works from a plain script, any thread, and inside a running event loop (a Jupyter
        cell): it then runs on a private loop in a helper thread. In async code use
        :meth:`stream` instead.
        """
        request_params = _params(params, overrides)
        opened = functools.partial(self.stream, params=request_params)
        return run_sync(generate_all(self.start, prompt_batch(prompts), opened, use_tqdm))

    def generate_chat(
        self,
        conversations: Sequence[dict[str, Any]] | Sequence[Sequence[dict[str, Any]]],
        params: SamplingParams | None = None,
        *,
        use_tqdm: bool = True,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        reasoning_parser: str | ReasoningParser | None = None,
        **overrides: Any,
    ) -> list[RequestOutput]:
        """Answer one conversation or a list of them and wait: the sync :meth:`chat`
        (vLLM's ``LLM.chat``).

        A conversation is a list of ``{"role": ..., "content": ...}`` messages; the model's
        chat template is applied and the assistant turn opened. ``params`` and keyword
        ``overrides`` work as in :meth:`stream`; ``chat_template_kwargs`` and
        ``reasoning_parser`` as in :meth:`chat`. Returns one final ``RequestOutput`` per
        conversation, in order; runs from scripts, threads and Jupyter cells like
        :meth:`generate`.
        """
        request_params = _params(params, overrides)
        opened = functools.partial(
            self.chat,
            params=request_params,
            chat_template_kwargs=chat_template_kwargs,
            reasoning_parser=reasoning_parser,
        )
        return run_sync(
            generate_all(self.start, conversation_batch(conversations), opened, use_tqdm)
        )

    async def tokenize(
        self,
        prompt: str | None = None,
        *,
        messages: Sequence[dict[str, Any]] | None = None,
        add_special_tokens: bool | None = None,
    ) -> list[int]:
        """The token ids of ``prompt``, or of ``messages`` through the chat template (by
        default as :meth:`stream` and :meth:`chat` would send them: special tokens added to
        a prompt, not to a rendered chat). Large inputs are tokenized off the event loop;
        untokenizable text raises ``RequestError``."""
        if messages is not None:
            size = chat_size(messages, limit=self.config.max_inline_prompt_chars)
            source = PromptSource.of_chat(messages, None, size, bool(add_special_tokens))
        elif isinstance(prompt, str):
            special = add_special_tokens is None or add_special_tokens
            source = PromptSource.of_prompt(prompt, special, len(prompt))
        else:
            raise RequestError("give a prompt string or messages", param="prompt")
        return await self._submitter.token_ids(source)

    async def detokenize(self, token_ids: Sequence[int]) -> str:
        """The text of ``token_ids`` (``tokenizer.decode``, special tokens kept); decoded on
        a worker thread when there are more than ``max_inline_prompt_chars // 4``."""
        (text,) = await self.detokenize_all([token_ids])
        return text

    async def detokenize_all(self, prompts: Sequence[Sequence[int]]) -> list[str]:
        """:meth:`detokenize` for several token-id lists at once: off the event loop when
        they hold more than ``max_inline_prompt_chars // 4`` ids together."""
        return await self._submitter.texts([list(ids) for ids in prompts])


def _params(params: SamplingParams | None, overrides: dict[str, Any]) -> SamplingParams:
    base = params if params is not None else SamplingParams()
    return base.with_overrides(**overrides) if overrides else base
