"""`llgraph chat MODEL`: an interactive conversation in the terminal (llama.cpp's conversation mode). Each line is
a user turn, the reply streams back; /reset forgets the turns, /system TEXT sets the system message (and resets),
/help lists these, Ctrl-D (or /exit) leaves. Any other `/word` alone is an unknown command, said so, not sent to the
model (a line such as `/usr/bin holds what?` is text)."""

from __future__ import annotations

import re
import sys

HELP = "(/reset forgets the conversation, /system TEXT sets the system message, /help, Ctrl-D or /exit leaves)"


def cmd_chat(args) -> int:
    from llgraph.errors import RequestError
    from llgraph.runtime.cli.args import check_sampling_flags, runner_of, sampling_of, share_threads_for_a_draft
    from llgraph.runtime.engine.chat import Conversation

    check_sampling_flags(args)  # before loading
    share_threads_for_a_draft(args)
    runner = runner_of(args)
    chat = Conversation(runner, args.system, args.max_new_tokens, **sampling_of(args, runner))
    print(f"chatting with {args.model} {HELP}", file=sys.stderr)
    while True:
        sys.stdout.write("> ")  # on stdout with the replies (input()'s own prompt may go to stderr)
        sys.stdout.flush()
        try:
            line = input()
        except EOFError:
            print()
            return 0
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            return 0
        if text == "/reset":
            chat.reset()
            print("(conversation reset)")
            continue
        if text == "/system" or text.startswith("/system "):
            chat.reset(text[len("/system"):].strip() or None, keep_system=False)
            print("(system message set; conversation reset)")
            continue
        if text == "/help":
            print(HELP)
            continue
        if re.fullmatch(r"/[A-Za-z][\w-]*", text):
            print(f"(unknown command {text}) {HELP}")
            continue
        dropped = chat.dropped
        try:
            for piece in chat.say(line):
                sys.stdout.write(piece)
                sys.stdout.flush()
        except RequestError as e:
            print(f"llgraph: {e}", file=sys.stderr)
            continue
        except KeyboardInterrupt:  # stops this reply, keeps the conversation
            pass
        print()
        if chat.dropped > dropped:
            print(f"(the oldest turns were dropped to stay within {runner.backend.max_seq_len} tokens)",
                  file=sys.stderr)
