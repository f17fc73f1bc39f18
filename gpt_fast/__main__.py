from gpt_fast.cli.main import main

if __name__ == "__main__":  # not when a spawned process (bench) imports this module again
    main()
