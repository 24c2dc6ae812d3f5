"""orchestrator.engine.daemon_client: one reading of a daemon reply for every client (the CLI's socket, the in-process
daemon, the HTTP front's link), each caller wording the failures its own way."""
import asyncio

import pytest

from orchestrator.terminal import cli
from orchestrator.engine.daemon_client import DaemonClient, DaemonDown, DaemonRefused, read_reply
from protocol import messages as m


class _Replies:
    """A stand-in daemon answering every request with `reply` (as the wire codec carries it)."""

    def __init__(self, reply):
        self.reply, self.seen = reply, []

    def handle(self, msg):
        self.seen.append(msg)
        return self.reply


def test_read_reply_three_outcomes():
    assert read_reply(m.Ok(id=3, note="x"), m.Ok, "CANCEL").note == "x"
    with pytest.raises(DaemonRefused) as refused:
        read_reply(m.error_reply(3, "failed", "no job 2025"), m.Ok, "CANCEL")
    assert (refused.value.code, refused.value.message, refused.value.unknown_job) == ("failed", "no job 2025", True)
    with pytest.raises(DaemonDown, match="answered CANCEL with JOBS"):
        read_reply(m.Jobs(id=3, jobs=()), m.Ok, "CANCEL")


@pytest.mark.parametrize("reply, code, text", [
    (m.error_reply(0, "bad_request", "steps: too many", field="steps"), cli.EXIT_USAGE, "steps: too many"),
    (m.error_reply(0, "busy", "the queue is full"), cli.EXIT_FAILED, "the queue is full"),
    (m.Jobs(jobs=()), cli.EXIT_FAILED, "answered CANCEL with JOBS"),     # was a ProtocolError traceback
])
def test_the_cli_words_each_failure_with_its_exit_status(reply, code, text):
    daemon = _Replies(reply)
    client = DaemonClient.in_process(daemon, errors=cli.cli_error)
    with pytest.raises(cli.CliError, match=text) as e:
        client.call(m.Cancel(job="20250101-000000-abcdef"), m.Ok)
    assert e.value.code == code
    assert [type(x) for x in daemon.seen] == [m.Cancel]


def test_the_http_link_reads_replies_the_same_way(tmp_path):
    """DaemonLink over a real DEALER/ROUTER pair: an ERROR is DaemonRefused, another kind DaemonDown."""
    import zmq
    import zmq.asyncio
    from orchestrator.http.link import DaemonLink
    from protocol import codec

    endpoint = f"ipc://{tmp_path}/d.sock"

    async def main():
        ctx = zmq.asyncio.Context()
        router = ctx.socket(zmq.ROUTER)
        router.bind(endpoint)
        link = DaemonLink(endpoint, timeout_s=5.0)
        await link.start()
        await asyncio.sleep(0.3)                  # ZMQ_IMMEDIATE: the send waits for the connection

        async def serve(reply_of):
            frames = await router.recv_multipart()
            msg = codec.decode(frames[2:])
            await router.send_multipart([frames[0], b"", *codec.encode(reply_of(msg.id))])
        try:
            server = asyncio.ensure_future(serve(lambda i: m.error_reply(i, "failed", "no job x")))
            with pytest.raises(DaemonRefused, match="no job x"):
                await link.call(m.Cancel(job="20250101-000000-abcdef"), m.Ok)
            await server
            server = asyncio.ensure_future(serve(lambda i: m.Jobs(id=i, jobs=())))
            with pytest.raises(DaemonDown, match="answered CANCEL with JOBS"):
                await link.call(m.Cancel(job="20250101-000000-abcdef"), m.Ok)
            await server
        finally:
            await link.close()
            router.close(0)
            ctx.term()
    asyncio.run(main())
