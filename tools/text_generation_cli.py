"""Interactive client of the text generation server (Megatron's tools/text_generation_cli.py).

    python tools/text_generation_cli.py localhost:5000

Loops: reads a prompt and a number of tokens, PUTs {"prompts": [prompt], "tokens_to_generate": n}
to http://<host:port>/api and prints the text. Unlike Megatron's client it reads the number with
int() rather than eval(), prints the server's validation errors (bare JSON strings) instead of
crashing on them, exits with one `error:` line when the server cannot be reached, and exits
cleanly at end of input.
"""

import json
import re
import sys

import requests


def _error_message(response):
    try:
        body = response.json()
    except ValueError:
        return response.text.strip()
    if isinstance(body, dict):
        return body.get('message', json.dumps(body))
    return str(body)


def main(argv):
    if len(argv) != 2:
        print(f"usage: {argv[0]} <host:port>", file=sys.stderr)
        return 2
    url = 'http://' + argv[1] + '/api'
    headers = {'Content-Type': 'application/json'}

    while True:
        try:
            sentence = input("Enter prompt: ")
            tokens_text = input("Enter number of tokens to generate: ")
        except EOFError:
            print()
            return 0
        try:
            tokens_to_generate = int(tokens_text)
        except ValueError:
            print(f"Error: the number of tokens must be an integer, got {tokens_text!r}")
            continue
        data = {"prompts": [sentence], "tokens_to_generate": tokens_to_generate}
        try:
            response = requests.put(url, data=json.dumps(data), headers=headers)
        except requests.RequestException as exc:
            # The innermost reason ("Connection refused"), not urllib3's nested repr.
            found = re.search(r"\[Errno -?\d+\] ([^'\")]+)", str(exc))
            reason = found.group(1) if found else type(exc).__name__
            print(
                f"error: cannot reach the text generation server at {url}: {reason}; is it "
                f"running?",
                file=sys.stderr,
            )
            return 1

        body = None
        if response.status_code == 200:
            try:
                body = response.json()
            except ValueError:
                body = None
        if response.status_code != 200:
            print(f"Error {response.status_code}: {_error_message(response)}")
        elif not isinstance(body, dict):
            # Megatron's server answers most validation errors with a string and status 200.
            print(f"Error: {_error_message(response)}")
        else:
            print("Megatron Response: ")
            print(body['text'][0])


if __name__ == "__main__":
    sys.exit(main(sys.argv))
