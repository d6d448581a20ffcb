"""Write a student copy of this project, for a course: `python student_copy.py ../assignment`.

Every solution region in the sources, the lines between
    # BEGIN SOLUTION exercise N: title
    # END SOLUTION
becomes `raise NotImplementedError('exercise N: title (EXERCISES.md)')`; the rest of the files git
tracks (and new ones it does not ignore) is copied as it is, with worked_step.txt: the reference's
`worked_step.py` tables. In the copy each exercise's tests fail with that message until the
student writes the part, and the rest pass (test_all.py checks both).
"""
import argparse
import os
import re
import subprocess
import sys

BEGIN = re.compile(r'^(\s*)# BEGIN SOLUTION (exercise \d+: .+)$')
END = re.compile(r'^\s*# END SOLUTION$')


def blank(source: str, path: str) -> str:
    """The source with each solution region replaced by a raise at the region's indentation."""
    out, start = [], None
    for number, line in enumerate(source.splitlines(keepends=True), 1):
        begin = BEGIN.match(line)
        if begin and start is not None:
            raise SystemExit(f'error: {path}:{number}: a BEGIN SOLUTION inside the one of line '
                             f'{start}')
        if begin:
            start = number
            out.append(f'{begin[1]}# {begin[2]}: write this part (EXERCISES.md)\n'
                       f'{begin[1]}raise NotImplementedError({begin[2] + " (EXERCISES.md)"!r})\n')
        elif start is None:
            out.append(line)
        elif END.match(line):
            start = None
    if start is not None:
        raise SystemExit(f'error: {path}:{start}: BEGIN SOLUTION without END SOLUTION')
    return ''.join(out)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('output', help='folder for the copy (must not exist yet, or be empty)')
    out = parser.parse_args(argv).output
    if os.path.exists(out) and os.listdir(out):
        sys.exit(f'error: {out} exists and is not empty')
    here = os.path.dirname(os.path.abspath(__file__))
    files = subprocess.run(['git', 'ls-files', '--cached', '--others', '--exclude-standard'],
                           cwd=here, capture_output=True, text=True, check=True).stdout.splitlines()
    regions = 0
    for name in files:
        source, target = os.path.join(here, name), os.path.join(out, name)
        if not os.path.isfile(source):  # deleted from the work tree, not yet from git
            continue
        os.makedirs(os.path.dirname(target) or '.', exist_ok=True)
        data = open(source, 'rb').read()
        if name.endswith('.py'):
            text = data.decode()
            regions += len([line for line in text.splitlines() if BEGIN.match(line)])
            data = blank(text, name).encode()
        open(target, 'wb').write(data)
        os.chmod(target, os.stat(source).st_mode)
    tables = subprocess.run([sys.executable, 'worked_step.py'], cwd=here, capture_output=True,
                            text=True, check=True).stdout  # what exercises 1-3 and 6 compute
    open(os.path.join(out, 'worked_step.txt'), 'w').write(tables)
    print(f'wrote {out}: {regions} solution regions left to the student; worked_step.txt holds '
          'the reference answers to exercises 1-3 and 6 at work on one group')


if __name__ == '__main__':
    main()
