.PHONY: demo test setup lint bench-hash compose-up compose-down

setup:
	bash scripts/setup.sh

demo:
	bash scripts/demo.sh

test:
	bash scripts/test.sh

lint:
	.venv/bin/ruff check . && .venv/bin/ruff format --check . && .venv/bin/mypy

bench-hash: setup
	.venv/bin/kvroute bench hash

# The Compose stack on this machine (docker/compose.local.yaml; docs/deployment.md).
compose-up:
	bash scripts/docker-stack.sh up

compose-down:
	bash scripts/docker-stack.sh down
