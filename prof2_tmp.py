import time, sys, random
from cluster import LLM, SamplingParams, StructuredOutputsParams as SO
from cluster.structured_output import StructuredOutputManager
schema = {"type":"object","properties":{"items":{"type":"array","items":{"type":"object","properties":{"id":{"type":"integer"},"ok":{"type":"boolean"},"name":{"type":"string"}},"required":["id","ok","name"]}}},"required":["items"]}
acc = {"mark":0.0,"bitmask":0.0,"on_result":0.0}
for name in list(acc):
    orig = getattr(StructuredOutputManager, name)
    def wrap(self, *a, _o=orig, _n=name, **k):
        t=time.perf_counter(); r=_o(self,*a,**k); acc[_n]+=time.perf_counter()-t; return r
    setattr(StructuredOutputManager, name, wrap)
rng = random.Random(0)
prompts = [{"prompt_token_ids":[rng.randrange(100,150000) for _ in range(rng.randint(32,256))]} for _ in range(32)]
with LLM("qwen3-tiny", max_num_seqs=64, async_scheduling=False) as llm:
    for rep in range(2):
        for so in [None, SO(json=schema)]:
            for k in acc: acc[k]=0.0
            s0 = llm.engine.num_steps
            t=time.perf_counter()
            outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True, structured_outputs=so), use_tqdm=False)
            dt=time.perf_counter()-t; steps = llm.engine.num_steps-s0
            n = sum(len(c.token_ids) for o in outs for c in o.outputs)
            print("json" if so else "plain", f"{n/dt:.0f} tok/s", f"{dt/steps*1e3:.1f} ms/step", {k: f"{v/steps*1e3:.2f}" for k,v in acc.items()})
    print(repr(outs[0].outputs[0].text[:200]))
