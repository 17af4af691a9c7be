from trainmover.cli import console_main

console_main()
