"""What kvtool's tools share that is not inference, as llama.cpp's common/ is beside llama.h:
built on the engine, imported by the commands, never by the engine itself."""
