from cluster import LLM, SamplingParams, StructuredOutputsParams as SO
with LLM("qwen3-tiny", executor="ray") as llm:
    llm.generate(["hi"]*4, SamplingParams(max_tokens=8, structured_outputs=SO(regex="[a-z]+")), use_tqdm=False)
print("done")
