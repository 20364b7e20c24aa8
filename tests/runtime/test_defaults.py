"""Sampling defaults: fields a request leaves unset take the engine's ``default_*`` options,
else the model's generation_config.json, else the fallback; an unset ``max_tokens`` is
``default_max_tokens`` cut to the context, never the whole context."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest

from inlinelm import SamplingParams
from inlinelm.api.protocol import Limits, parse_chat
from inlinelm.config import FALLBACK_COMPLETION_MAX_TOKENS, FALLBACK_SAMPLING
from inlinelm.gpu.loading.gguf_convert import DEFAULT_MODEL_GENERATION
from inlinelm.gpu.loading.model_files import (
    default_model_path,
    generation_defaults,
    resolve_model,
)
from inlinelm.runtime.admission import Admission
from tests.runtime.helpers import echo_engine, run


def test_a_request_without_max_tokens_gets_default_max_tokens() -> None:
    async def main() -> None:
        async with echo_engine(default_max_tokens=7) as engine:
            unset = await engine.stream("an echo that never ends", ignore_eos=True)
            assert len(unset.token_ids) == 7
            explicit = await engine.stream("an echo that never ends", ignore_eos=True, max_tokens=9)
            assert len(explicit.token_ids) == 9

    run(main())


def test_an_http_chat_without_max_tokens_is_capped_not_run_to_the_context_end() -> None:
    # The README's curl sent no max_tokens and ran to the context end (594 s).
    body = {"messages": [{"role": "user", "content": "hi"}], "ignore_eos": True}
    params = parse_chat(body, Limits()).params

    async def main() -> None:
        async with echo_engine(max_model_len=4096) as engine:
            out = await engine.chat(body["messages"], params)
            assert len(out.token_ids) == FALLBACK_SAMPLING["max_tokens"] == 1024

    run(main())


def test_a_completion_without_max_tokens_gets_16_as_in_vllm_and_openai() -> None:
    # The README's notebook generate() set none and ran 1024 tokens a prompt (68 s).
    async def main() -> None:
        async with echo_engine() as engine:
            out = await engine.stream("an echo that never ends", ignore_eos=True)
            assert len(out.token_ids) == FALLBACK_COMPLETION_MAX_TOKENS == 16
            assert engine.default_sampling_params().max_tokens == 16
            assert engine.default_sampling_params(chat=True).max_tokens == 1024
            outs = await asyncio.to_thread(
                engine.generate, ["one", "two"], ignore_eos=True, use_tqdm=False
            )
            assert [len(o.outputs[0].token_ids) for o in outs] == [16, 16]

    run(main())


def test_the_default_max_tokens_is_cut_to_the_room_the_prompt_leaves() -> None:
    async def main() -> None:
        async with echo_engine(max_model_len=40) as engine:
            messages = [{"role": "user", "content": "a prompt of a dozen or so tokens"}]
            n = len(engine.tokenizer.encode(engine.render_chat(messages)))
            out = await engine.chat(messages, ignore_eos=True)
            assert len(out.token_ids) == 40 - n

    run(main())


def test_default_sampling_params_shows_the_fallback_and_options_win() -> None:
    async def main() -> None:
        async with echo_engine(default_temperature=0.0, default_top_k=5) as engine:
            defaults = engine.default_sampling_params()
            assert (defaults.temperature, defaults.top_k) == (0.0, 5)
            assert defaults.top_p == FALLBACK_SAMPLING["top_p"]
            assert defaults.max_tokens == FALLBACK_COMPLETION_MAX_TOKENS
            assert engine.default_sampling_params(chat=True).max_tokens == 1024

    run(main())


def test_unset_fields_take_the_defaults_and_set_ones_win() -> None:
    admission = Admission(None, 100, 2048, {**FALLBACK_SAMPLING, "temperature": 0.2})
    params = SamplingParams(top_p=0.5)
    assert "top_p" not in params.unset_fields and "temperature" in params.unset_fields
    filled = admission.with_defaults(params, num_prompt_tokens=10)
    assert (filled.temperature, filled.top_p, filled.max_tokens) == (0.2, 0.5, 1024)
    assert not filled.unset_fields
    explicit = SamplingParams(temperature=1.0, max_tokens=None)
    kept = admission.with_defaults(explicit, num_prompt_tokens=10)
    assert (kept.temperature, kept.max_tokens) == (1.0, None)  # None: to the context end
    # Derived params keep what was unset, unset.
    derived = params.with_overrides(n=2).copy()
    assert derived.unset_fields == params.unset_fields and derived.top_p == 0.5
    assert "<engine default>" in repr(params)


def test_generation_config_values_become_the_defaults(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text(
        json.dumps(
            {
                "temperature": 0.6,
                "top_p": 0.9,
                "top_k": 20,
                "repetition_penalty": 1.05,
                "max_new_tokens": 512,
                "do_sample": True,
                "bos_token_id": 1,
            }
        )
    )
    assert generation_defaults(tmp_path) == {
        "temperature": 0.6,
        "top_p": 0.9,
        "top_k": 20,
        "repetition_penalty": 1.05,
        "max_tokens": 512,
    }


def test_a_bad_generation_config_value_is_ignored_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "generation_config.json").write_text('{"temperature": -3, "top_p": 0.8}')
    assert generation_defaults(tmp_path) == {"top_p": 0.8}
    assert "ignoring temperature" in caplog.text
    assert generation_defaults(tmp_path / "absent") == {}


def test_an_engine_on_a_model_folder_uses_its_generation_config(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    (folder / "generation_config.json").write_text('{"temperature": 0.3, "max_new_tokens": 5}')

    async def main() -> None:
        async with echo_engine(model=str(folder), default_top_k=3) as engine:
            defaults = engine.default_sampling_params()
            assert (defaults.temperature, defaults.max_tokens, defaults.top_k) == (0.3, 5, 3)
            out = await engine.stream("long enough to go past five tokens", ignore_eos=True)
            assert len(out.token_ids) == 5

    run(main())


def test_the_default_model_samples_as_its_model_card_recommends() -> None:
    files = resolve_model("default")
    assert dict(files.generation) == dict(DEFAULT_MODEL_GENERATION)
    assert (files.generation["temperature"], files.generation["top_p"]) == (0.2, 0.9)


def test_the_default_models_file_by_its_path_samples_as_by_its_name() -> None:
    # One rule for a GGUF however it is named: its sampling keys, else its model card's.
    by_name = resolve_model("default")
    by_path = resolve_model(str(default_model_path()))
    assert by_path.folder == by_name.folder
    assert dict(by_path.generation) == dict(by_name.generation) == dict(DEFAULT_MODEL_GENERATION)


def test_a_model_card_applies_only_to_the_file_it_names(tmp_path: Path) -> None:
    import gguf

    from inlinelm.gpu.loading.gguf_convert import MODEL_CARD_SAMPLING, _identity

    (organization, basename, size, _finetune), card = next(iter(MODEL_CARD_SAMPLING.items()))
    assert card == DEFAULT_MODEL_GENERATION
    path = tmp_path / "named.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_string("general.organization", organization)
    writer.add_string("general.basename", basename)
    writer.add_string("general.size_label", size)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    identity = _identity(gguf.GGUFReader(str(path)))
    assert identity == (organization, basename, size, "")  # another finetune: not the card's
    assert identity not in MODEL_CARD_SAMPLING


def test_gguf_sampling_keys_become_a_generation_config(tmp_path: Path) -> None:
    import gguf

    from inlinelm.gpu.loading.gguf_convert import _sampling_fields

    path = tmp_path / "sampling.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_float32("general.sampling.temp", 0.5)
    writer.add_int32("general.sampling.top_k", 40)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    values = _sampling_fields(gguf.GGUFReader(str(path)))
    assert values == {"temperature": 0.5, "top_k": 40}
