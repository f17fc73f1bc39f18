from gpt_fast.cli import main

main()
