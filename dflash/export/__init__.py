"""The drafter export: the contract its readers (z-lab reference, SGLang, vLLM) rely on."""
