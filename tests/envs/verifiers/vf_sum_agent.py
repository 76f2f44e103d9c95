"""The agent (``env.agents``) that trains the verifiers environment ``vf_sum`` unchanged, through the bridge."""

from pathlib import Path

from rlray.envs.servers.verifiers import verifiers_agent

agent = verifiers_agent({"taskset": {"id": "vf_sum"}, "agent": {"harness": {"id": "null"}}}, paths=[Path(__file__).parent])
