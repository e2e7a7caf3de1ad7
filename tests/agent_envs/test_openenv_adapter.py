"""OpenEnv environments through the session endpoint, on the echo environment openenv-core ships as its `openenv
init` template: in this process and through its server's client, every episode's reward is what the environment
computes from the replies the sample trains on, the observations are in the sample, the tokens are the engine's
and scored as the trainer scores them; a short `twinplane train` through it; bad settings are one-line errors.
Runs in its own virtual environment (.ci/agent-envs-lane); skipped without openenv-core."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import assert_multi_turn_logprobs_match_trainer, rows, train

pytest.importorskip("openenv.core")
sys.path.insert(0, str(Path(__file__).parents[1] / "serving"))

from chat_model import chat_model_dir, record_calls  # noqa: E402
from openenv.cli.commands import init as openenv_init  # noqa: E402
from pydantic import Field  # noqa: E402

from twinplane.agents.openenv_adapter import action_type, describe, observation_text, text_action  # noqa: E402
from twinplane.agents.runner import AgentRollout  # noqa: E402
from twinplane.cli import main  # noqa: E402
from twinplane.data.prompts import Prompt  # noqa: E402
from twinplane.model.weights import load_model  # noqa: E402
from twinplane.rollout import RolloutEngine, SamplingParams  # noqa: E402
from twinplane.serving.server import BackgroundServer  # noqa: E402
from twinplane.serving.templates import ChatTemplate  # noqa: E402
from twinplane.tokenizer import load_tokenizer  # noqa: E402

ECHO = "echo_env.server.echo_env_environment:EchoEnvironment"
TURNS = 3  # the echo environment never ends an episode: each runs agent.max_turns steps


@pytest.fixture(scope="module")
def echo_env(tmp_path_factory):
    """The package's `openenv init echo_env` scaffold (its echo environment, models, client and server app),
    importable as `echo_env`."""
    root = tmp_path_factory.mktemp("openenv")
    saved = openenv_init._generate_uv_lock
    openenv_init._generate_uv_lock = lambda env_dir: False  # (its uv lock step: not needed to import it)
    try:
        openenv_init.init("echo_env", output_dir=str(root))
    finally:
        openenv_init._generate_uv_lock = saved
    sys.path.insert(0, str(root))
    yield root / "echo_env"
    sys.path.remove(str(root))


@pytest.fixture(scope="module")
def chat_folder(tmp_path_factory):
    return chat_model_dir(tmp_path_factory.mktemp("chat") / "model")


def rollout(folder: Path, spec: str, n: int = 2, concurrency: int = 8):
    tok, model = load_tokenizer(folder), load_model(folder, "cpu", "float32")
    engine = RolloutEngine(model, tok.eos_token_id, tok.pad_token_id)
    sp = SamplingParams(temperature=1.0, max_new_tokens=96, n=n)
    agents = AgentRollout(spec, engine, tok, sp, 256, ChatTemplate.from_model_dir(folder), concurrency=concurrency,
                          timeout_s=120, max_turns=TURNS, seed=0)
    return agents, model, tok


def prompts(tok) -> list[Prompt]:
    return [Prompt(tok.encode(f"{a}+{a}="), str(2 * a), f"{a}+{a}=", {"prompt": f"{a}+{a}=", "answer": str(2 * a)})
            for a in (3, 7)]


def runs(s, eos: int) -> list[tuple[int, list[int]]]:
    """A sample's tokens after its prompt as (loss mask, ids) runs; replies lose the stop token the client never
    sees."""
    out: list[tuple[int, list[int]]] = []
    for t, k in zip(s.token_ids, s.loss_mask, strict=True):
        if out and out[-1][0] == k:
            out[-1][1].append(t)
        else:
            out.append((k, [t]))
    return [(k, ids[:-1] if k == 1 and ids[-1] == eos else ids) for k, ids in out]


def check_echo_episodes(agents, model, tok) -> None:
    """Each episode's reward is the echo environment's, 0.1 per character of each reply, over the replies its
    sample trains on; each reply comes back as the next user turn, the echo observation's fields as JSON; each
    call's prompt is the trajectory so far and its tokens follow at once; log-probs are the trainer's."""
    calls = record_calls(agents.loop)
    try:
        samples, rewards, _, m = agents.run(prompts(tok), step=0)
    finally:
        agents.close()
    assert m["agent/episodes"] == 4 and m["agent/errors"] == 0 and m["agent/splits"] == 0
    assert m["agent/env_steps"] == TURNS and len(samples) == 4
    done = [(ids, f.result()[0].token_ids) for ids, f in calls]
    for s, reward in zip(samples, rewards.tolist(), strict=True):
        parts = runs(s, tok.eos_token_id)
        replies = [tok.decode(ids, skip_special_tokens=False) for k, ids in parts if k == 1]
        assert reward == pytest.approx(sum(0.1 * len(r) for r in replies), rel=1e-6)  # (float32)
        assert 1 <= len(replies) <= TURNS and max(map(len, replies)) > 0
        for j, (k, ids) in enumerate(parts):
            if k == 0:  # the observation of the reply before it (cut where the sample's budget ended)
                shown = json.dumps({"echoed_message": replies[j // 2], "message_length": len(replies[j // 2])})
                assert shown in tok.decode(ids, skip_special_tokens=False) or \
                    (j == len(parts) - 1 and s.finish_reason == "length")
        assert "Echo Env environment ready!" in tok.decode(s.prompt_ids)  # the reset's observation opens the chat
        whole = s.prompt_ids + s.token_ids
        mine = [(ids, out) for ids, out in done if whole[:len(ids) + len(out)] == ids + out and out]
        assert len(mine) == len(replies) and min(len(ids) for ids, _ in mine) == len(s.prompt_ids)
    assert len({r for r in rewards.tolist()}) > 1  # (the replies differ, so do the rewards)
    assert_multi_turn_logprobs_match_trainer(model, samples, tok.pad_token_id, 1.0)


def test_echo_environment_in_process_rewards_the_replies_the_samples_train_on(echo_env, chat_folder):
    check_echo_episodes(*rollout(chat_folder, ECHO))


def test_echo_environment_through_its_servers_client(echo_env, chat_folder, tmp_path):
    from echo_env.models import EchoAction, EchoObservation
    from echo_env.server.echo_env_environment import EchoEnvironment
    from openenv.core.env_server.http_server import create_app

    app = create_app(EchoEnvironment, EchoAction, EchoObservation, env_name="echo_env", max_concurrent_envs=4)
    server = BackgroundServer(app)
    url = server.start()
    (tmp_path / "agent.py").write_text(textwrap.dedent(f"""
        from echo_env.client import EchoEnv
        from twinplane.agents.openenv_adapter import openenv_environment

        Echo = openenv_environment(EchoEnv, base_url={url!r})
    """))
    try:
        check_echo_episodes(*rollout(chat_folder, f"{tmp_path / 'agent.py'}:Echo", concurrency=4))
    finally:
        server.stop()


def test_replies_become_actions_and_observations_text_as_documented(echo_env):
    from echo_env.models import EchoAction, EchoObservation
    from echo_env.server.echo_env_environment import EchoEnvironment
    from openenv.core import Action, EnvClient, Environment, GenericEnvClient

    class Move(Action):
        row: int
        col: int = Field(ge=0)
        note: str = ""

    assert action_type(EchoEnvironment, Environment, EnvClient) is EchoAction  # (its step's annotation)
    assert action_type(GenericEnvClient, Environment, EnvClient).__origin__ is dict  # (its generic base)
    assert text_action(EchoAction)("hi there") == EchoAction(message="hi there")
    to_move = text_action(Move)  # two required fields: the reply is read as JSON
    assert to_move('{"row": 1, "col": 2}') == Move(row=1, col=2)
    with pytest.raises(ValueError) as bad:
        to_move('{"row": 1, "col": -2}')
    assert describe(bad.value) == "col: Input should be greater than or equal to 0"
    with pytest.raises(ValueError) as bad:
        to_move("row 1, col 2")
    assert describe(bad.value).startswith("Invalid JSON")
    assert text_action(dict)('{"code": "x = 1"}') == {"code": "x = 1"}
    with pytest.raises(ValueError, match="expected a JSON object, got list"):
        text_action(dict)("[1]")
    assert observation_text(EchoObservation(echoed_message="a\nb", message_length=3, reward=0.3, done=True)) == \
        '{"echoed_message": "a\\nb", "message_length": 3}'
    assert observation_text({"prompt": "your move", "reward": 1.0}) == "your move"


def test_a_reply_that_is_no_action_is_answered_with_the_error_and_scores_zero(echo_env):
    import asyncio

    from openenv.core import Action, Environment, Observation, State

    from twinplane.agents.openenv_adapter import openenv_environment

    class Move(Action):
        row: int
        col: int

    class Board(Observation):
        text: str

    class Grid(Environment[Move, Board, State]):  # (its Action type from the generic base)
        def reset(self, seed=None, episode_id=None, **kwargs) -> Board:
            self.seed, self.kwargs = seed, kwargs
            return Board(text=f"seed {seed}")

        def step(self, action, timeout_s=None, **kwargs) -> Board:
            return Board(text=f"{action.row},{action.col}", reward=float(action.row + action.col), done=True)

        @property
        def state(self) -> State:
            return State()

    played = openenv_environment(Grid)()

    async def episode():
        first = await played.reset({"prompt": "p", "answer": "a", "seed": 7})
        return first, played.env.env.kwargs, await played.step("three, four"), await played.step('{"row": 3, "col": 4}')

    first, kwargs, bad, good = asyncio.run(episode())
    assert first == "seed 7" and kwargs == {"prompt": "p", "answer": "a"}  # (reset takes **kwargs: every field)
    assert bad[1:] == (0.0, False) and bad[0].startswith("invalid action: Invalid JSON")
    assert good == ("3,4", 7.0, True)


def test_a_short_training_run_through_the_echo_environment(echo_env, chat_folder, tmp_path):
    run = ["warmstart.steps=0", "train.steps=3", "rollout.prompts_per_step=2", "rollout.n=2",
           "rollout.max_new_tokens=24", "agent.max_turns=2", "task.heldout_size=8", "eval.before=false",
           "eval.every=0", "log.progress=false", "checkpoint.every=0", "train.micro_batch_size=4"]
    assert train(tmp_path / "run", f"model.path={chat_folder}", f"agent.entrypoint={ECHO}", args=run) == 0
    steps = [r for r in rows(tmp_path / "run") if r["step"] >= 1]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all(r["agent/episodes"] == 4 and r["agent/errors"] == 0 and r["agent/env_steps"] == 2 for r in steps)
    assert all(r["agent/reward_mean"] > 0 for r in steps)  # (0.1 per character echoed)


def test_an_openenv_client_without_its_server_is_a_one_line_error(echo_env, tmp_path, capsys):
    assert main(["train", "--run-dir", str(tmp_path / "r"), "warmstart.steps=0", "model.hidden_size=32",
                 "agent.entrypoint=echo_env.client:EchoEnv"]) == 2
    err = capsys.readouterr().err.strip()  # (after the run's header: the agents start once the model is built)
    assert "agent.entrypoint: EchoEnv is an OpenEnv client: give its server, openenv_environment(EchoEnv, " \
           "base_url=...)" in err.splitlines()[-1] and "Traceback" not in err
