.PHONY: demo test setup lint bench-hash

setup:
	bash scripts/setup.sh

demo:
	bash scripts/demo.sh

test:
	bash scripts/test.sh

lint:
	.venv/bin/ruff check . && .venv/bin/ruff format --check .

bench-hash: setup
	.venv/bin/kvroute bench hash
